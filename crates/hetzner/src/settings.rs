//! The production settings of the servers an offering creates: image (name, id or label
//! selector), private networks (optionally a subnet), firewalls, public IPv4/IPv6, the address
//! SSH goes to, spread placement, operator labels and login SSH keys.
//!
//! Every setting is a global flag and an optional field of an offering in the `--offerings`
//! JSON that overrides the flag for that offering. [`ServerSpec`] is one offering's effective
//! settings; [`Overrides`] are the fields an offering sets. Validation here is syntax and
//! combinations only (no API call); names and IDs are resolved by [`crate::resolve`]. Every
//! error names the offering, the flag or field, and the value.

use std::collections::BTreeMap;

use provider_core::offerings::Offering;
use serde_json::Value;

use crate::labels;

/// Which address of a server the provider's SSH connection goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SshAddress {
    /// The public IPv4, exactly as the API reports it (the reference's behaviour).
    #[default]
    Public,
    /// The server's address on its first private network, for a management network the
    /// control plane trusts; no public address is then used for SSH.
    Private,
    /// The server's public IPv6 address (the first address of its /64, which Hetzner
    /// configures); IPv6-only servers use this.
    Ipv6,
}

impl SshAddress {
    /// Parses `--ssh-address` / `ssh_address`.
    pub fn parse(value: &str) -> Result<SshAddress, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "public" => Ok(SshAddress::Public),
            "private" => Ok(SshAddress::Private),
            "ipv6" => Ok(SshAddress::Ipv6),
            other => Err(format!(
                "--ssh-address must be public, private or ipv6 (got {other:?})"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SshAddress::Public => "public",
            SshAddress::Private => "private",
            SshAddress::Ipv6 => "ipv6",
        }
    }
}

/// Placement of an offering's servers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// No placement group.
    #[default]
    None,
    /// Provider-owned spread placement groups, one after the other as they fill up.
    Spread,
}

impl Placement {
    pub fn parse(value: &str) -> Result<Placement, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "none" => Ok(Placement::None),
            "spread" => Ok(Placement::Spread),
            other => Err(format!("must be none or spread (got {other:?})")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Placement::None => "none",
            Placement::Spread => "spread",
        }
    }
}

/// A private network by name or ID, optionally with the IP range of one of its subnets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkRef {
    pub network: String,
    /// `10.0.1.0/24`: the server is attached to this subnet (after create, by
    /// `attach_to_network`, the only way the API places a server in a chosen subnet).
    pub subnet: Option<String>,
}

impl NetworkRef {
    /// `NAME_OR_ID` or `NAME_OR_ID=SUBNET_CIDR`.
    pub fn parse(text: &str) -> Result<NetworkRef, String> {
        let (network, subnet) = match text.split_once('=') {
            Some((n, s)) => (n.trim(), Some(s.trim())),
            None => (text.trim(), None),
        };
        if network.is_empty() {
            return Err(format!("{text:?} names no network"));
        }
        if let Some(subnet) = subnet {
            ipv4_cidr(subnet).map_err(|e| format!("{text:?}: subnet {e}"))?;
        }
        Ok(NetworkRef {
            network: network.to_owned(),
            subnet: subnet.map(str::to_owned),
        })
    }

    pub fn display(&self) -> String {
        match &self.subnet {
            Some(s) => format!("{}={s}", self.network),
            None => self.network.clone(),
        }
    }
}

/// Checks an IPv4 CIDR (`10.0.1.0/24`).
pub fn ipv4_cidr(text: &str) -> Result<(), String> {
    let bad = || format!("{text:?} is not an IPv4 range like 10.0.1.0/24");
    let (ip, bits) = text.split_once('/').ok_or_else(bad)?;
    ip.parse::<std::net::Ipv4Addr>().map_err(|_| bad())?;
    match bits.parse::<u8>() {
        Ok(b) if b <= 32 => Ok(()),
        _ => Err(bad()),
    }
}

/// Hetzner's label key rule: an optional DNS-subdomain prefix and `/`, then a name of at most
/// 63 characters that starts and ends alphanumeric with `-`, `_` and `.` inside.
pub fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    !name.is_empty() && labels::is_label_value(name) && prefix_ok
}

/// Whether a label key belongs to this provider (ownership, machine id, pins, bindings).
pub fn is_reserved_key(key: &str) -> bool {
    key.starts_with("bigfleet-")
}

/// Parses `key=value` (one `--server-label`).
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (k, v) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not key=value"))?;
    check_label(k, v)?;
    Ok((k.to_owned(), v.to_owned()))
}

fn check_label(key: &str, value: &str) -> Result<(), String> {
    if !is_label_key(key) {
        return Err(format!(
            "label key {key:?} is not a Hetzner label key (optional DNS prefix and '/', then \
             1-63 characters, alphanumeric at both ends, '-', '_' and '.' inside)"
        ));
    }
    if is_reserved_key(key) {
        return Err(format!(
            "label key {key:?} is reserved: keys starting with \"bigfleet-\" carry this \
             provider's ownership, machine ids and host-key pins"
        ));
    }
    if !labels::is_label_value(value) {
        return Err(format!(
            "label value {value:?} (key {key:?}) is not a Hetzner label value (at most 63 \
             characters, alphanumeric at both ends, '-', '_' and '.' inside)"
        ));
    }
    Ok(())
}

/// Checks an image selector `k=v,k2=v2` and returns it normalised (no blanks).
pub fn parse_image_selector(text: &str) -> Result<String, String> {
    let mut pairs = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("{text:?}: {part:?} is not key=value"))?;
        let (k, v) = (k.trim(), v.trim());
        if !is_label_key(k) || !labels::is_label_value(v) {
            return Err(format!(
                "{text:?}: {part:?} is not a valid Hetzner label key=value"
            ));
        }
        pairs.push(format!("{k}={v}"));
    }
    Ok(pairs.join(","))
}

/// One offering's effective server settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSpec {
    /// Image by name or ID; empty when `image_selector` is used.
    pub image: String,
    /// Label selector `k=v,...`: the newest matching snapshot or image of the server type's
    /// architecture; empty when `image` is used.
    pub image_selector: String,
    pub networks: Vec<NetworkRef>,
    pub firewalls: Vec<String>,
    pub public_ipv4: bool,
    pub public_ipv6: bool,
    pub ssh_address: SshAddress,
    pub placement: Placement,
    /// Operator labels of every server (ours are added on top; they never collide).
    pub labels: BTreeMap<String, String>,
    /// Hetzner SSH keys (name or ID) added to the server for operators.
    pub login_keys: Vec<String>,
}

impl Default for ServerSpec {
    fn default() -> ServerSpec {
        ServerSpec {
            image: String::new(),
            image_selector: String::new(),
            networks: Vec::new(),
            firewalls: Vec::new(),
            public_ipv4: true,
            public_ipv6: true,
            ssh_address: SshAddress::Public,
            placement: Placement::None,
            labels: BTreeMap::new(),
            login_keys: Vec::new(),
        }
    }
}

/// The settings fields an offering of the `--offerings` JSON sets (absent: the flag applies).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub server_type: String,
    pub location: String,
    pub image: Option<String>,
    pub image_selector: Option<String>,
    pub networks: Option<Vec<NetworkRef>>,
    pub firewalls: Option<Vec<String>>,
    pub public_ipv4: Option<bool>,
    pub public_ipv6: Option<bool>,
    pub ssh_address: Option<SshAddress>,
    pub placement: Option<Placement>,
    /// Merged over the `--server-label` labels (an offering's value wins per key).
    pub server_labels: Option<BTreeMap<String, String>>,
    pub login_ssh_keys: Option<Vec<String>>,
}

impl Overrides {
    fn is_empty(&self) -> bool {
        *self
            == Overrides {
                server_type: self.server_type.clone(),
                location: self.location.clone(),
                ..Default::default()
            }
    }
}

/// The settings field names an offering may carry.
pub const FIELDS: &[&str] = &[
    "image",
    "image_selector",
    "networks",
    "firewalls",
    "public_ipv4",
    "public_ipv6",
    "ssh_address",
    "placement",
    "server_labels",
    "login_ssh_keys",
];

fn strings(value: &Value) -> Result<Vec<String>, String> {
    match value {
        Value::String(s) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
                Value::Number(n) => Ok(n.to_string()),
                other => Err(format!("expected a name or ID, got {other}")),
            })
            .collect(),
        other => Err(format!("expected a list of names or IDs, got {other}")),
    }
}

fn network_refs(value: &Value) -> Result<Vec<NetworkRef>, String> {
    let Value::Array(items) = value else {
        return strings(value)?
            .iter()
            .map(|s| NetworkRef::parse(s))
            .collect();
    };
    items
        .iter()
        .map(|item| match item {
            Value::String(s) => NetworkRef::parse(s),
            Value::Number(n) => NetworkRef::parse(&n.to_string()),
            Value::Object(o) => {
                let network = match o.get("network") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Number(n)) => n.to_string(),
                    other => {
                        return Err(format!(
                            "\"network\": expected a name or ID, got {}",
                            other.map_or("nothing".to_owned(), Value::to_string)
                        ));
                    }
                };
                match o.get("subnet") {
                    None | Some(Value::Null) => NetworkRef::parse(&network),
                    Some(Value::String(s)) => NetworkRef::parse(&format!("{network}={s}")),
                    Some(other) => Err(format!("\"subnet\": expected a string, got {other}")),
                }
            }
            other => Err(format!("expected a network, got {other}")),
        })
        .collect()
}

fn boolean(value: &Value) -> Result<bool, String> {
    match value {
        Value::Bool(b) => Ok(*b),
        other => Err(format!("expected true or false, got {other}")),
    }
}

fn text(value: &Value) -> Result<String, String> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(format!("expected a string, got {other}")),
    }
}

/// Reads the settings fields of every offering of an offerings document, in document order.
/// `type_key`/`zone_key` name the offering. Documents without any of these fields parse to
/// overrides that change nothing.
pub fn parse_overrides(text_doc: &str) -> Result<Vec<Overrides>, String> {
    let value: Value = serde_json::from_str(text_doc).map_err(|e| e.to_string())?;
    let Value::Array(items) = value else {
        return Err("expected a JSON array of offerings".into());
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Value::Object(object) = item else {
            return Err(format!("offering {i}: expected an object"));
        };
        let get = |key: &str| {
            object
                .get(key)
                .or_else(|| {
                    object
                        .iter()
                        .find(|(k, _)| k.eq_ignore_ascii_case(key))
                        .map(|(_, v)| v)
                })
                .filter(|v| !v.is_null())
        };
        let name = |key: &str| get(key).and_then(|v| v.as_str()).unwrap_or("").to_owned();
        let mut o = Overrides {
            server_type: name("server_type"),
            location: name("location"),
            ..Default::default()
        };
        let at = |field: &str, e: String| {
            format!(
                "offering {i} ({}/{}): field {field:?}: {e}",
                o_name(object, "server_type"),
                o_name(object, "location")
            )
        };
        if let Some(v) = get("image") {
            o.image = Some(text(v).map_err(|e| at("image", e))?.trim().to_owned());
        }
        if let Some(v) = get("image_selector") {
            let raw = text(v).map_err(|e| at("image_selector", e))?;
            o.image_selector =
                Some(parse_image_selector(&raw).map_err(|e| at("image_selector", e))?);
        }
        if let Some(v) = get("networks") {
            o.networks = Some(network_refs(v).map_err(|e| at("networks", e))?);
        }
        if let Some(v) = get("firewalls") {
            o.firewalls = Some(strings(v).map_err(|e| at("firewalls", e))?);
        }
        if let Some(v) = get("public_ipv4") {
            o.public_ipv4 = Some(boolean(v).map_err(|e| at("public_ipv4", e))?);
        }
        if let Some(v) = get("public_ipv6") {
            o.public_ipv6 = Some(boolean(v).map_err(|e| at("public_ipv6", e))?);
        }
        if let Some(v) = get("ssh_address") {
            let raw = text(v).map_err(|e| at("ssh_address", e))?;
            o.ssh_address = Some(SshAddress::parse(&raw).map_err(|_| {
                at(
                    "ssh_address",
                    format!("must be public, private or ipv6 (got {raw:?})"),
                )
            })?);
        }
        if let Some(v) = get("placement") {
            let raw = text(v).map_err(|e| at("placement", e))?;
            o.placement = Some(Placement::parse(&raw).map_err(|e| at("placement", e))?);
        }
        if let Some(v) = get("server_labels") {
            let Value::Object(map) = v else {
                return Err(at("server_labels", format!("expected an object, got {v}")));
            };
            let mut labels = BTreeMap::new();
            for (k, v) in map {
                let v = match v {
                    Value::String(s) => s.clone(),
                    other => {
                        return Err(at(
                            "server_labels",
                            format!("{k}: expected a string, got {other}"),
                        ));
                    }
                };
                check_label(k, &v).map_err(|e| at("server_labels", e))?;
                labels.insert(k.clone(), v);
            }
            o.server_labels = Some(labels);
        }
        if let Some(v) = get("login_ssh_keys") {
            o.login_ssh_keys = Some(strings(v).map_err(|e| at("login_ssh_keys", e))?);
        }
        out.push(o);
    }
    Ok(out)
}

fn o_name(object: &serde_json::Map<String, Value>, key: &str) -> String {
    object
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

/// Reads the settings fields of `--offerings PATH`.
pub fn load_overrides(path: &std::path::Path) -> Result<Vec<Overrides>, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("read offerings {shown}: {e}"))?;
    parse_overrides(&text).map_err(|e| format!("parse offerings {shown}: {e}"))
}

/// One offering with its effective settings and which of them its own fields set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfferingSpec {
    pub server_type: String,
    pub location: String,
    pub spec: ServerSpec,
    /// The offering's own fields (names the right source in messages).
    pub overrides: Overrides,
}

impl OfferingSpec {
    /// `cx22/nbg1`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.server_type, self.location)
    }

    /// How a message names the setting `field`: the offering's field when it set it, else the
    /// flag.
    pub fn source(&self, field: &str) -> String {
        let o = &self.overrides;
        let own = match field {
            "image" => o.image.is_some() || o.image_selector.is_some(),
            "image_selector" => o.image_selector.is_some() || o.image.is_some(),
            "networks" => o.networks.is_some(),
            "firewalls" => o.firewalls.is_some(),
            "public_ipv4" => o.public_ipv4.is_some(),
            "public_ipv6" => o.public_ipv6.is_some(),
            "ssh_address" => o.ssh_address.is_some(),
            "placement" => o.placement.is_some(),
            "server_labels" => o.server_labels.is_some(),
            "login_ssh_keys" => o.login_ssh_keys.is_some(),
            _ => false,
        };
        if own {
            format!("offering {} field {field:?}", self.key())
        } else {
            let flag = match field {
                "image_selector" => "--image-selector",
                "networks" => "--network",
                "firewalls" => "--firewall",
                "public_ipv4" => "--public-ipv4",
                "public_ipv6" => "--public-ipv6",
                "ssh_address" => "--ssh-address",
                "placement" => "--placement",
                "server_labels" => "--server-label",
                "login_ssh_keys" => "--login-ssh-key",
                _ => "--image",
            };
            format!("offering {} {flag}", self.key())
        }
    }

    /// The combination checks: an image, a reachable SSH address, at most one use of each
    /// network. `Err` names the setting and value at fault.
    pub fn validate(&self) -> Result<(), String> {
        let s = &self.spec;
        if s.image.is_empty() && s.image_selector.is_empty() {
            return Err(format!(
                "offering {}: no image: set --image or --image-selector (or the offering's \
                 \"image\" or \"image_selector\" field)",
                self.key()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for n in &s.networks {
            if !seen.insert(n.network.as_str()) {
                return Err(format!(
                    "{}: network {:?} is listed twice",
                    self.source("networks"),
                    n.network
                ));
            }
        }
        if !s.public_ipv4 && !s.public_ipv6 && s.networks.iter().all(|n| n.subnet.is_some()) {
            return Err(format!(
                "offering {}: public_ipv4 and public_ipv6 are both off, so the server needs a \
                 private network it joins at create time (one without a subnet); {} is {:?}",
                self.key(),
                self.source("networks"),
                s.networks
                    .iter()
                    .map(NetworkRef::display)
                    .collect::<Vec<_>>()
            ));
        }
        let address = self.source("ssh_address");
        let value = s.ssh_address.name();
        match s.ssh_address {
            SshAddress::Public if !s.public_ipv4 => Err(format!(
                "{address} {value:?} needs a public IPv4, but {} is false (use \"private\" \
                 with a network or \"ipv6\")",
                self.source("public_ipv4")
            )),
            SshAddress::Ipv6 if !s.public_ipv6 => Err(format!(
                "{address} {value:?} needs a public IPv6, but {} is false",
                self.source("public_ipv6")
            )),
            SshAddress::Private if s.networks.is_empty() => Err(format!(
                "{address} {value:?} needs a private network, but {} is empty",
                self.source("networks")
            )),
            _ => Ok(()),
        }
    }
}

/// The effective settings of every offering: the global `defaults` overridden by each
/// offering's fields (matched by server type and location). Overrides that name no offering
/// are ignored (they came from an offering validation already rejected); two offerings of one
/// server type and location must agree.
pub fn offering_specs(
    defaults: &ServerSpec,
    offerings: &[Offering],
    overrides: &[Overrides],
) -> Result<Vec<OfferingSpec>, String> {
    let mut out: Vec<OfferingSpec> = Vec::new();
    for offering in offerings {
        let mine: Vec<&Overrides> = overrides
            .iter()
            .filter(|o| o.server_type == offering.instance_type && o.location == offering.zone)
            .collect();
        let own = mine.first().map(|o| (*o).clone()).unwrap_or(Overrides {
            server_type: offering.instance_type.clone(),
            location: offering.zone.clone(),
            ..Default::default()
        });
        if let Some(other) = mine.iter().skip(1).find(|o| ***o != own) {
            let _ = other;
            return Err(format!(
                "offerings {}/{}: two offerings of the same server type and location set \
                 different server settings; merge them into one",
                offering.instance_type, offering.zone
            ));
        }
        if out
            .iter()
            .any(|s| s.server_type == offering.instance_type && s.location == offering.zone)
        {
            continue;
        }
        let spec = apply(defaults, &own);
        let entry = OfferingSpec {
            server_type: offering.instance_type.clone(),
            location: offering.zone.clone(),
            spec,
            overrides: own,
        };
        out.push(entry);
    }
    Ok(out)
}

fn apply(defaults: &ServerSpec, o: &Overrides) -> ServerSpec {
    if o.is_empty() {
        return defaults.clone();
    }
    let mut s = defaults.clone();
    match (&o.image, &o.image_selector) {
        (Some(image), None) => {
            s.image = image.clone();
            s.image_selector.clear();
        }
        (None, Some(selector)) => {
            s.image.clear();
            s.image_selector = selector.clone();
        }
        // Both: kept both, refused by `check_images`.
        (Some(image), Some(selector)) => {
            s.image = image.clone();
            s.image_selector = selector.clone();
        }
        (None, None) => {}
    }
    if let Some(n) = &o.networks {
        s.networks = n.clone();
    }
    if let Some(f) = &o.firewalls {
        s.firewalls = f.clone();
    }
    if let Some(v) = o.public_ipv4 {
        s.public_ipv4 = v;
    }
    if let Some(v) = o.public_ipv6 {
        s.public_ipv6 = v;
    }
    if let Some(v) = o.ssh_address {
        s.ssh_address = v;
    }
    if let Some(v) = o.placement {
        s.placement = v;
    }
    if let Some(l) = &o.server_labels {
        s.labels.extend(l.clone());
    }
    if let Some(k) = &o.login_ssh_keys {
        s.login_keys = k.clone();
    }
    s
}

/// Refuses an image set twice in one place (`--image` with `--image-selector`, or an
/// offering's `image` with its `image_selector`).
pub fn check_images(spec: &OfferingSpec) -> Result<(), String> {
    if !spec.spec.image.is_empty() && !spec.spec.image_selector.is_empty() {
        return Err(format!(
            "offering {}: set either an image ({:?}) or an image selector ({:?}), not both",
            spec.key(),
            spec.spec.image,
            spec.spec.image_selector
        ));
    }
    Ok(())
}

/// Every offering's settings, validated: the first problem is the error.
pub fn validated_specs(
    defaults: &ServerSpec,
    offerings: &[Offering],
    overrides: &[Overrides],
) -> Result<Vec<OfferingSpec>, String> {
    let specs = offering_specs(defaults, offerings, overrides)?;
    for spec in &specs {
        check_images(spec)?;
        spec.validate()?;
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use provider_core::machine::StringMap;

    fn offering(t: &str, z: &str) -> Offering {
        Offering {
            instance_type: t.into(),
            zone: z.into(),
            capacity_type: String::new(),
            count: 1,
            resources: StringMap::new(),
            labels: StringMap::new(),
        }
    }

    fn defaults() -> ServerSpec {
        ServerSpec {
            image: "ubuntu-24.04".into(),
            ..Default::default()
        }
    }

    #[test]
    fn reference_offerings_parse_unchanged() {
        let doc = r#"[{"server_type":"cx22","location":"nbg1","capacity_type":"on_demand","count":2,
            "resources":{"cpu":"2"},"labels":{"tier":"a"}}]"#;
        let o = parse_overrides(doc).unwrap();
        assert_eq!(o.len(), 1);
        assert!(o[0].is_empty());
        let specs = validated_specs(&defaults(), &[offering("cx22", "nbg1")], &o).unwrap();
        assert_eq!(specs[0].spec, defaults());
    }

    #[test]
    fn offering_fields_override_the_flags() {
        let doc = r#"[{"server_type":"cx22","location":"nbg1",
            "image_selector":"k8s-version=1.31, role=node",
            "networks":["bigfleet-mgmt=10.0.1.0/24",{"network":9002}],
            "firewalls":"fw-a,fw-b","public_ipv4":false,"ssh_address":"private",
            "placement":"spread","server_labels":{"team":"core"},"login_ssh_keys":[5001,"ops-bob"]}]"#;
        let o = parse_overrides(doc).unwrap();
        let mut global = defaults();
        global.labels.insert("env".into(), "prod".into());
        global.labels.insert("team".into(), "infra".into());
        let specs = validated_specs(&global, &[offering("cx22", "nbg1")], &o).unwrap();
        let s = &specs[0].spec;
        assert_eq!(s.image, "");
        assert_eq!(s.image_selector, "k8s-version=1.31,role=node");
        assert_eq!(
            s.networks,
            vec![
                NetworkRef {
                    network: "bigfleet-mgmt".into(),
                    subnet: Some("10.0.1.0/24".into())
                },
                NetworkRef {
                    network: "9002".into(),
                    subnet: None
                }
            ]
        );
        assert_eq!(s.firewalls, vec!["fw-a", "fw-b"]);
        assert!(!s.public_ipv4 && s.public_ipv6);
        assert_eq!(s.ssh_address, SshAddress::Private);
        assert_eq!(s.placement, Placement::Spread);
        assert_eq!(s.labels["team"], "core");
        assert_eq!(s.labels["env"], "prod");
        assert_eq!(s.login_keys, vec!["5001", "ops-bob"]);
    }

    #[test]
    fn bad_fields_name_offering_field_and_value() {
        let cases = [
            (r#""networks":["a=10.0.1/24"]"#, "field \"networks\""),
            (r#""public_ipv4":"no""#, "field \"public_ipv4\""),
            (r#""ssh_address":"bastion""#, "\"bastion\""),
            (r#""placement":"pack""#, "\"pack\""),
            (r#""server_labels":{"bigfleet-managed":"x"}"#, "reserved"),
            (r#""server_labels":{"a":"-x"}"#, "\"-x\""),
            (r#""server_labels":{"Bad Key":"x"}"#, "\"Bad Key\""),
            (r#""image_selector":"role""#, "field \"image_selector\""),
            (r#""firewalls":[{}]"#, "field \"firewalls\""),
        ];
        for (field, want) in cases {
            let doc = format!(r#"[{{"server_type":"cx22","location":"nbg1",{field}}}]"#);
            let e = parse_overrides(&doc).unwrap_err();
            assert!(e.contains("offering 0 (cx22/nbg1)"), "{e}");
            assert!(e.contains(want), "{field}: {e}");
        }
    }

    #[test]
    fn impossible_combinations_are_refused() {
        let o = |doc: &str| {
            let doc = format!(r#"[{{"server_type":"cx22","location":"nbg1",{doc}}}]"#);
            validated_specs(
                &defaults(),
                &[offering("cx22", "nbg1")],
                &parse_overrides(&doc).unwrap(),
            )
        };
        let e = o(r#""public_ipv4":false"#).unwrap_err();
        assert!(
            e.contains("offering cx22/nbg1 --ssh-address \"public\" needs a public IPv4"),
            "{e}"
        );
        assert!(e.contains("field \"public_ipv4\" is false"), "{e}");
        let e = o(r#""public_ipv6":false,"ssh_address":"ipv6""#).unwrap_err();
        assert!(
            e.contains("field \"ssh_address\" \"ipv6\" needs a public IPv6"),
            "{e}"
        );
        let e = o(r#""ssh_address":"private""#).unwrap_err();
        assert!(e.contains("needs a private network"), "{e}");
        let e = o(r#""public_ipv4":false,"public_ipv6":false,"ssh_address":"private","networks":["n=10.0.1.0/24"]"#).unwrap_err();
        assert!(e.contains("both off"), "{e}");
        let e = o(r#""networks":["n","n"]"#).unwrap_err();
        assert!(e.contains("listed twice"), "{e}");
        let e = o(r#""image":"x","image_selector":"a=b""#).unwrap_err();
        assert!(e.contains("not both"), "{e}");
        assert!(o(r#""public_ipv4":false,"ssh_address":"ipv6""#).is_ok());
        assert!(o(r#""public_ipv4":false,"public_ipv6":false,"ssh_address":"private","networks":["n"]"#).is_ok());
        let mut no_image = defaults();
        no_image.image.clear();
        let e = validated_specs(&no_image, &[offering("cx22", "nbg1")], &[]).unwrap_err();
        assert!(e.contains("no image"), "{e}");
    }

    #[test]
    fn same_placement_offerings_must_agree() {
        let doc = r#"[{"server_type":"cx22","location":"nbg1","placement":"spread"},
                      {"server_type":"cx22","location":"nbg1"}]"#;
        let o = parse_overrides(doc).unwrap();
        let offerings = [offering("cx22", "nbg1"), offering("cx22", "nbg1")];
        assert!(validated_specs(&defaults(), &offerings, &o).is_err());
    }

    #[test]
    fn labels_and_selectors() {
        assert_eq!(
            parse_label("team=core").unwrap(),
            ("team".into(), "core".into())
        );
        assert!(parse_label("example.com/team=core").is_ok());
        assert!(parse_label("team").is_err());
        assert!(
            parse_label("bigfleet-cluster=x")
                .unwrap_err()
                .contains("reserved")
        );
        assert!(parse_label("a=b/c").is_err());
        assert!(parse_label("Example.com/x=y").is_err());
        assert_eq!(parse_image_selector("a=1, b=2").unwrap(), "a=1,b=2");
        assert!(parse_image_selector("a!=1").is_err());
        assert!(parse_image_selector("").is_err());
        assert!(NetworkRef::parse("=10.0.0.0/24").is_err());
        assert!(NetworkRef::parse("n=10.0.0.0/33").is_err());
        assert_eq!(SshAddress::parse("IPv6").unwrap(), SshAddress::Ipv6);
        assert!(
            SshAddress::parse("x")
                .unwrap_err()
                .contains("public, private or ipv6")
        );
    }
}
