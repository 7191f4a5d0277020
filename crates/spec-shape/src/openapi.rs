//! Validation of JSON answers against an OpenAPI document's response schemas, for the subset
//! of the schema language the vendored excerpts (`official/`) use: `type` (a name or a list of
//! names, `null` among them), `nullable`, `required`, `properties`, `additionalProperties`,
//! `items`, `enum`, `format: date-time`, `allOf`, `oneOf`, `anyOf` and `$ref` to a JSON pointer
//! within the same document. Other keywords (`minimum`, `pattern`, …) are not checked; the
//! excerpts leave them out.

use serde_json::{Map, Value};

use crate::is_rfc3339;

/// An OpenAPI document (or an excerpt of one), read from JSON.
#[derive(Clone, Debug)]
pub struct Document {
    root: Value,
}

impl Document {
    /// Reads a document from its JSON text.
    pub fn from_json(text: &str) -> Result<Document, serde_json::Error> {
        Ok(Document {
            root: serde_json::from_str(text)?,
        })
    }

    /// The document itself.
    pub fn root(&self) -> &Value {
        &self.root
    }

    /// The operation `method` (any case) on the path template `path` (as the document spells
    /// it, e.g. `/servers/{id}`).
    pub fn operation(&self, method: &str, path: &str) -> Option<&Value> {
        self.root["paths"]
            .get(path)?
            .get(method.to_ascii_lowercase())
    }

    /// Every operation of the document as `(METHOD, path template, operationId)`.
    pub fn operations(&self) -> Vec<(String, String, String)> {
        let mut all = Vec::new();
        for (path, ops) in self.root["paths"].as_object().into_iter().flatten() {
            for (method, op) in ops.as_object().into_iter().flatten() {
                let id = op["operationId"].as_str().unwrap_or_default().to_owned();
                all.push((method.to_ascii_uppercase(), path.clone(), id));
            }
        }
        all
    }

    /// The schema of the answer `status` to `method path`: the response listed for the status
    /// itself, else for its range (`4XX`/`4xx`), else `default`. `Ok(None)` when that response
    /// has no JSON body; `Err` when the document lists no such operation or response.
    pub fn response_schema(
        &self,
        method: &str,
        path: &str,
        status: u16,
    ) -> Result<Option<&Value>, String> {
        let op = self
            .operation(method, path)
            .ok_or_else(|| format!("the document has no operation {method} {path}"))?;
        let responses = &op["responses"];
        let range = format!("{}XX", status / 100);
        let response = [
            status.to_string(),
            range.clone(),
            range.to_ascii_lowercase(),
            "default".to_owned(),
        ]
        .iter()
        .find_map(|key| responses.get(key))
        .ok_or_else(|| format!("the document lists no answer {status} to {method} {path}"))?;
        Ok(response.get("schema"))
    }

    /// Every way the answer `status` with `body` to `method path` breaks the document. `at`
    /// prefixes each problem (`GET /servers`); the rest of a problem is the JSON path of the
    /// value (`.servers[0].server_type.cores`) and what is wrong with it.
    pub fn check_answer(
        &self,
        method: &str,
        path: &str,
        status: u16,
        body: &Value,
        at: &str,
    ) -> Vec<String> {
        match self.response_schema(method, path, status) {
            Err(e) => vec![format!("{at}: {e}")],
            Ok(None) if body.is_null() => Vec::new(),
            Ok(None) => vec![format!("{at}: the document gives answer {status} no body")],
            Ok(Some(schema)) => self.validate(schema, body, at),
        }
    }

    /// Every way `value` (found at `at`) breaks `schema`, a schema of this document.
    pub fn validate(&self, schema: &Value, value: &Value, at: &str) -> Vec<String> {
        let mut problems = Vec::new();
        self.walk(schema, value, at, &mut problems);
        problems
    }

    /// The schema `$ref` names (`#/components/schemas/x`), or `None` if it is not within the
    /// document.
    pub fn resolve(&self, reference: &str) -> Option<&Value> {
        self.root.pointer(reference.strip_prefix('#')?)
    }

    /// `schema` with its `$ref`s followed.
    fn deref<'a>(&'a self, mut schema: &'a Value, at: &str) -> Result<&'a Value, String> {
        let mut hops = 0;
        while let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
            schema = self
                .resolve(reference)
                .ok_or_else(|| format!("{at}: the document has no {reference}"))?;
            hops += 1;
            if hops > 64 {
                return Err(format!("{at}: {reference} refers to itself"));
            }
        }
        Ok(schema)
    }

    fn walk(&self, schema: &Value, value: &Value, at: &str, problems: &mut Vec<String>) {
        let schema = match self.deref(schema, at) {
            Ok(s) => s,
            Err(e) => return problems.push(e),
        };
        let Some(s) = schema.as_object() else {
            // `true`/`{}`: anything goes.
            return;
        };
        for part in s
            .get("allOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.walk(part, value, at, problems);
        }
        if let Some(alternatives) = s.get("oneOf").and_then(Value::as_array) {
            let outcomes = self.alternatives(alternatives, value, at);
            let matched = outcomes.iter().filter(|p| p.is_empty()).count();
            if matched == 0 {
                problems.push(none_matched("oneOf", &outcomes, at));
            } else if matched > 1 {
                problems.push(format!(
                    "{at}: matches {matched} of the oneOf alternatives, not exactly one"
                ));
            }
        }
        if let Some(alternatives) = s.get("anyOf").and_then(Value::as_array) {
            let outcomes = self.alternatives(alternatives, value, at);
            if outcomes.iter().all(|p| !p.is_empty()) {
                problems.push(none_matched("anyOf", &outcomes, at));
            }
        }
        let nullable = s.get("nullable").and_then(Value::as_bool) == Some(true)
            || types(s).is_some_and(|t| t.contains(&"null"));
        if value.is_null() {
            if !nullable && (types(s).is_some() || s.contains_key("enum")) {
                problems.push(format!("{at}: null, the document does not allow it"));
            }
            return;
        }
        if let Some(allowed) = types(s)
            && !allowed.iter().any(|t| has_type(value, t))
        {
            return problems.push(format!(
                "{at}: {} is not of type {}",
                short(value),
                allowed.join(" or ")
            ));
        }
        if let Some(values) = s.get("enum").and_then(Value::as_array)
            && !values.contains(value)
        {
            problems.push(format!(
                "{at}: {} is not one of {}",
                short(value),
                Value::Array(values.clone())
            ));
        }
        if s.get("format").and_then(Value::as_str) == Some("date-time")
            && let Some(text) = value.as_str()
            && !is_rfc3339(text)
        {
            problems.push(format!("{at}: {text:?} is not an RFC 3339 date-time"));
        }
        if let Some(items) = value.as_array()
            && let Some(item) = s.get("items")
        {
            for (i, v) in items.iter().enumerate() {
                self.walk(item, v, &format!("{at}[{i}]"), problems);
            }
        }
        if let Some(object) = value.as_object() {
            self.object(s, object, at, problems);
        }
    }

    fn object(
        &self,
        s: &Map<String, Value>,
        object: &Map<String, Value>,
        at: &str,
        problems: &mut Vec<String>,
    ) {
        for key in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(key) = key.as_str()
                && !object.contains_key(key)
            {
                problems.push(format!("{at}.{key}: required, missing"));
            }
        }
        let properties = s.get("properties").and_then(Value::as_object);
        for (key, v) in object {
            let at = format!("{at}.{key}");
            match (
                properties.and_then(|p| p.get(key)),
                s.get("additionalProperties"),
            ) {
                (Some(schema), _) => self.walk(schema, v, &at, problems),
                (None, Some(Value::Bool(false))) => {
                    problems.push(format!("{at}: the document allows no such key"))
                }
                (None, Some(extra)) if extra.is_object() => self.walk(extra, v, &at, problems),
                (None, _) => {}
            }
        }
    }

    fn alternatives(&self, alternatives: &[Value], value: &Value, at: &str) -> Vec<Vec<String>> {
        alternatives
            .iter()
            .map(|a| self.validate(a, value, at))
            .collect()
    }

    /// `value` with every property whose schema `schema` marks `deprecated: true` removed, at
    /// every depth: the answer the API gives once it drops what it deprecated.
    pub fn without_deprecated(&self, schema: &Value, value: &Value) -> Value {
        let mut value = value.clone();
        self.strip(schema, &mut value);
        value
    }

    fn strip(&self, schema: &Value, value: &mut Value) {
        let Ok(schema) = self.deref(schema, "") else {
            return;
        };
        let Some(s) = schema.as_object() else { return };
        for key in ["allOf", "oneOf", "anyOf"] {
            for part in s.get(key).and_then(Value::as_array).into_iter().flatten() {
                // Only an alternative the value matches says what its keys are.
                if key == "allOf" || self.validate(part, value, "").is_empty() {
                    self.strip(part, value);
                }
            }
        }
        match value {
            Value::Array(items) => {
                if let Some(item) = s.get("items") {
                    for v in items {
                        self.strip(item, v);
                    }
                }
            }
            Value::Object(object) => {
                let properties = s.get("properties").and_then(Value::as_object);
                let extra = s.get("additionalProperties").filter(|e| e.is_object());
                object.retain(|key, _| {
                    let property = properties.and_then(|p| p.get(key));
                    !property.is_some_and(|p| self.is_deprecated(p))
                });
                for (key, v) in object.iter_mut() {
                    if let Some(property) = properties.and_then(|p| p.get(key)).or(extra) {
                        self.strip(property, v);
                    }
                }
            }
            _ => {}
        }
    }

    /// Whether `schema` (or what it refers to) is marked `deprecated: true`.
    pub fn is_deprecated(&self, schema: &Value) -> bool {
        let own = schema.get("deprecated").and_then(Value::as_bool) == Some(true);
        own || self
            .deref(schema, "")
            .is_ok_and(|s| s.get("deprecated").and_then(Value::as_bool) == Some(true))
    }
}

fn types(s: &Map<String, Value>) -> Option<Vec<&str>> {
    match s.get("type")? {
        Value::String(t) => Some(vec![t.as_str()]),
        Value::Array(ts) => Some(ts.iter().filter_map(Value::as_str).collect()),
        _ => None,
    }
}

fn has_type(value: &Value, name: &str) -> bool {
    match name {
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        _ => false,
    }
}

fn none_matched(keyword: &str, outcomes: &[Vec<String>], at: &str) -> String {
    let why: Vec<String> = outcomes
        .iter()
        .enumerate()
        .map(|(i, p)| format!("#{i}: {}", p.join("; ")))
        .collect();
    format!(
        "{at}: matches none of the {keyword} alternatives ({})",
        why.join(" | ")
    )
}

/// A value, cut short for a message.
fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(60) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn doc() -> Document {
        Document::from_json(
            &json!({
                "paths": {"/things/{id}": {"get": {"operationId": "get_thing", "responses": {
                    "200": {"schema": {"type": "object", "required": ["thing"],
                            "properties": {"thing": {"$ref": "#/components/schemas/thing"}}}},
                    "204": {},
                    "4xx": {"schema": {"type": "object", "required": ["error"], "properties": {
                        "error": {"type": "object", "required": ["code"],
                                  "properties": {"code": {"type": "string"}}}}}},
                    "default": {"schema": {"type": "object", "required": ["id"]}}
                }}}},
                "components": {"schemas": {
                    "thing": {"type": "object", "required": ["id", "status", "when", "old"],
                        "properties": {
                            "id": {"type": "integer"},
                            "status": {"type": "string", "enum": ["on", "off"]},
                            "when": {"type": ["string", "null"], "format": "date-time"},
                            "size": {"type": "number", "nullable": true},
                            "old": {"type": "boolean", "deprecated": true},
                            "kernel": {"$ref": "#/components/schemas/kernel"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "labels": {"type": "object",
                                       "additionalProperties": {"type": "string"}},
                            "net": {"oneOf": [
                                {"type": "object", "required": ["v4"],
                                 "properties": {"v4": {"type": "string"}}},
                                {"type": "object", "required": ["v6"],
                                 "properties": {"v6": {"type": "string"}}}]},
                            "closed": {"type": "object", "additionalProperties": false,
                                       "allOf": [{"required": ["a"]}],
                                       "properties": {"a": {"type": "integer"}}},
                            "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]}
                        }},
                    "kernel": {"type": "object", "deprecated": true,
                               "properties": {"id": {"type": "integer"}}}
                }}
            })
            .to_string(),
        )
        .unwrap()
    }

    #[test]
    fn a_conforming_answer_passes() {
        let good = json!({"thing": {
            "id": 1, "status": "on", "when": null, "size": null, "old": false,
            "kernel": {"id": 3}, "tags": ["a"], "labels": {"k": "v"}, "net": {"v4": "x"},
            "closed": {"a": 1}, "any": "x", "undocumented": [1]
        }});
        let d = doc();
        assert_eq!(
            d.check_answer("GET", "/things/{id}", 200, &good, "GET"),
            Vec::<String>::new()
        );
        assert!(
            d.check_answer("get", "/things/{id}", 204, &Value::Null, "x")
                .is_empty()
        );
        let error = json!({"error": {"code": "not_found"}});
        assert!(
            d.check_answer("GET", "/things/{id}", 404, &error, "x")
                .is_empty()
        );
        assert!(
            d.check_answer("GET", "/things/{id}", 503, &json!({"id": "x"}), "x")
                .is_empty()
        );
    }

    #[test]
    fn every_mismatch_is_reported_with_its_path() {
        let bad = json!({"thing": {
            "id": 1.5, "status": "paused", "when": "2026-07-01 12:00", "size": "big",
            "tags": ["a", 2], "labels": {"k": 1}, "net": {"v5": "x"},
            "closed": {"b": 1}, "any": true
        }});
        let mut problems = doc().check_answer("GET", "/things/{id}", 200, &bad, "GET /things/{id}");
        problems.sort();
        let mut expected = vec![
            "GET /things/{id}.thing.old: required, missing",
            "GET /things/{id}.thing.id: 1.5 is not of type integer",
            "GET /things/{id}.thing.status: \"paused\" is not one of [\"on\",\"off\"]",
            "GET /things/{id}.thing.when: \"2026-07-01 12:00\" is not an RFC 3339 date-time",
            "GET /things/{id}.thing.size: \"big\" is not of type number",
            "GET /things/{id}.thing.tags[1]: 2 is not of type string",
            "GET /things/{id}.thing.labels.k: 1 is not of type string",
            "GET /things/{id}.thing.net: matches none of the oneOf alternatives \
                 (#0: GET /things/{id}.thing.net.v4: required, missing | \
                 #1: GET /things/{id}.thing.net.v6: required, missing)",
            "GET /things/{id}.thing.closed.a: required, missing",
            "GET /things/{id}.thing.closed.b: the document allows no such key",
            "GET /things/{id}.thing.any: matches none of the anyOf alternatives \
                 (#0: GET /things/{id}.thing.any: true is not of type integer | \
                 #1: GET /things/{id}.thing.any: true is not of type string)",
        ];
        expected.sort();
        assert_eq!(problems, expected);
        let d = doc();
        assert_eq!(
            d.check_answer("GET", "/things", 200, &json!({}), "x"),
            vec!["x: the document has no operation GET /things"]
        );
        assert_eq!(
            d.check_answer("POST", "/things/{id}", 200, &json!({}), "x"),
            vec!["x: the document has no operation POST /things/{id}"]
        );
        let null_status = json!({"thing": {"id": 1, "status": null, "when": null, "old": true}});
        assert_eq!(
            d.check_answer("GET", "/things/{id}", 200, &null_status, "x"),
            vec!["x.thing.status: null, the document does not allow it"]
        );
    }

    #[test]
    fn deprecated_properties_are_removed_at_every_depth() {
        let d = doc();
        let schema = d
            .response_schema("GET", "/things/{id}", 200)
            .unwrap()
            .unwrap();
        let answer = json!({"thing": {"id": 1, "status": "on", "when": null, "old": true,
                                      "kernel": {"id": 3}, "tags": []}});
        assert_eq!(
            d.without_deprecated(schema, &answer),
            json!({"thing": {"id": 1, "status": "on", "when": null, "tags": []}})
        );
    }
}
