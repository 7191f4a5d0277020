//! Holding a running emulator to a document over HTTP: the driver both emulators' spec tests
//! call every operation through, and the read the providers' model tests decode from.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::Document;

/// Calls an emulator and checks each answer against the document's schema for its operation
/// and status, remembering which operations were answered.
pub struct Exercise {
    http: reqwest::Client,
    base: String,
    token: String,
    doc: Document,
    also: fn(&Value, &str) -> Vec<String>,
    problems: Vec<String>,
    /// `(METHOD, path template, status)` of every answer checked.
    seen: BTreeSet<(String, String, u16)>,
}

impl Exercise {
    /// Calls to `base` (the emulator's URL) with `token` as the bearer, held to `doc`.
    pub fn new(doc: Document, base: impl Into<String>, token: &str) -> Exercise {
        Exercise {
            http: loopback_client(),
            base: base.into(),
            token: token.to_owned(),
            doc,
            also: |_, _| Vec::new(),
            problems: Vec::new(),
            seen: BTreeSet::new(),
        }
    }

    /// Checks every answer with `check` too (given the answer and where it came from), for what
    /// the schema cannot say, such as a key the document dropped.
    pub fn also_checking(mut self, check: fn(&Value, &str) -> Vec<String>) -> Exercise {
        self.also = check;
        self
    }

    /// `method path` (`path` concrete, `template` as the document spells it), answered with
    /// `status` (asserted) and a body whose problems against the document are kept for
    /// [`Exercise::assert_complete`]; returns the body (`null` when empty).
    pub async fn call(
        &mut self,
        method: &str,
        template: &str,
        path: &str,
        body: Option<Value>,
        status: u16,
    ) -> Value {
        let verb = reqwest::Method::from_bytes(method.as_bytes())
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        let mut request = self
            .http
            .request(verb, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let got = response.status().as_u16();
        let text = response
            .text()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let answer: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: {e}: {text}"))
        };
        assert_eq!(got, status, "{method} {path}: {answer}");
        let at = format!("{method} {template} {status}");
        self.problems.extend(
            self.doc
                .check_answer(method, template, status, &answer, &at),
        );
        self.problems.extend((self.also)(&answer, &at));
        self.seen.insert((method.into(), template.into(), status));
        answer
    }

    /// [`Exercise::call`] of `GET path` without a body.
    pub async fn get(&mut self, template: &str, path: &str, status: u16) -> Value {
        self.call("GET", template, path, None, status).await
    }

    /// [`Exercise::call`] of `DELETE path` without a body.
    pub async fn delete(&mut self, template: &str, path: &str, status: u16) -> Value {
        self.call("DELETE", template, path, None, status).await
    }

    /// Asserts that every operation of the document was answered at least once and that no
    /// answer had a problem.
    pub fn assert_complete(&self) {
        let answered: BTreeSet<(&str, &str)> = self
            .seen
            .iter()
            .map(|(m, p, _)| (m.as_str(), p.as_str()))
            .collect();
        for (method, path, _) in self.doc.operations() {
            assert!(
                answered.contains(&(method.as_str(), path.as_str())),
                "{method} {path} was not exercised"
            );
        }
        assert!(self.problems.is_empty(), "{}", self.problems.join("\n"));
    }
}

/// An HTTP client for an emulator on loopback, never through a proxy.
pub fn loopback_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client")
}

/// GETs `base` + `path` with `token` as the bearer, asserts that the answer validates against
/// `doc`'s schema for `GET template` 200, and returns it with the same answer less every
/// property the document marks `deprecated: true`: what a provider's models must decode.
pub async fn get_without_deprecated(
    doc: &Document,
    base: &str,
    token: &str,
    template: &str,
    path: &str,
) -> (Value, Value) {
    let answer: Value = loopback_client()
        .get(format!("{base}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let schema = doc
        .response_schema("GET", template, 200)
        .expect("in the excerpt")
        .expect("a body");
    let problems = doc.validate(schema, &answer, path);
    assert!(problems.is_empty(), "{problems:#?}");
    let stripped = doc.without_deprecated(schema, &answer);
    (answer, stripped)
}
