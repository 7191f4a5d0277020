//! What each offering's Droplets are created with besides size and region: the image (slug,
//! numeric id or snapshot name), the VPC, extra tags, IPv6, the monitoring agent and login SSH
//! keys. Global flags give the defaults; the same fields in an offering of `--offerings`
//! override them for that offering (`tags` add to `--tag`). Everything is checked offline
//! first ([`plan`]), then names and ids are resolved against the API ([`Resolver`]) at startup
//! and again at the price-refresh cadence (or taken from the last run's file,
//! [`crate::profile_cache`]), so a Create sends ready values and makes no extra call.

use std::collections::{BTreeSet, HashMap};

use provider_core::offerings::Offering;
use provider_core::retry::Verdict;
use serde_json::Value;
use tokio::time::Instant;

use crate::api::{ApiClient, ApiError, Image, ImageRef, Size, SshKeyRef};
use crate::naming::{
    BOOTING_TAG_PREFIX, CLUSTER_TAG_PREFIX, MACHINE_TAG_PREFIX, MANAGED_TAG, PROVIDER_TAG_PREFIX,
};

/// The global flags: defaults of every offering.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Defaults {
    /// `--image`.
    pub image: String,
    /// `--vpc-uuid`; empty for the region's default VPC.
    pub vpc_uuid: String,
    /// `--tag`.
    pub tags: Vec<String>,
    /// `--ipv6`.
    pub ipv6: bool,
    /// `--monitoring`.
    pub monitoring: bool,
    /// `--login-ssh-key`.
    pub ssh_keys: Vec<String>,
}

/// The optional fields of one offering.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OfferingFields {
    pub image: Option<String>,
    pub vpc_uuid: Option<String>,
    pub tags: Vec<String>,
    pub ipv6: Option<bool>,
    pub monitoring: Option<bool>,
    pub ssh_keys: Option<Vec<String>>,
}

/// Where a value came from, for messages: a flag or a field of the offering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Flag(&'static str),
    Field(&'static str),
}

/// A configured value with its source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting<T> {
    pub value: T,
    pub from: Source,
}

impl Setting<String> {
    /// `offering s-2vcpu-4gb/nyc3 field image "x"` or `offering s-2vcpu-4gb/nyc3 --image "x"`:
    /// the offering, the field or flag and the value, as every message names them.
    pub fn describe(&self, offering: &str) -> String {
        match self.from {
            Source::Flag(flag) => format!("offering {offering} {flag} {:?}", self.value),
            Source::Field(field) => format!("offering {offering} field {field} {:?}", self.value),
        }
    }
}

/// One offering's settings, merged and checked offline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// `size/region`, as messages name the offering.
    pub label: String,
    pub size: String,
    pub region: String,
    pub image: Setting<String>,
    pub vpc_uuid: Option<Setting<String>>,
    /// Extra tags, flags first, without duplicates.
    pub tags: Vec<Setting<String>>,
    pub ipv6: bool,
    pub monitoring: bool,
    pub ssh_keys: Vec<Setting<String>>,
}

/// What a Create of one offering sends besides name, size, region, user_data and our tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropletProfile {
    pub image: ImageRef,
    pub vpc_uuid: Option<String>,
    pub tags: Vec<String>,
    pub ipv6: bool,
    pub monitoring: bool,
    pub ssh_keys: Vec<SshKeyRef>,
}

impl DropletProfile {
    /// A profile with only an image (the settings of the flags' defaults).
    pub fn with_image(image: ImageRef) -> DropletProfile {
        DropletProfile {
            image,
            vpc_uuid: None,
            tags: Vec::new(),
            ipv6: false,
            monitoring: false,
            ssh_keys: Vec::new(),
        }
    }
}

/// The per-offering fields of an offerings document, one entry per offering in file order
/// (the order [`provider_core::offerings::parse`] keeps).
pub fn offering_fields(text: &str) -> Result<Vec<OfferingFields>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let Value::Array(items) = value else {
        return Err("expected a JSON array of offerings".into());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(object) = item else {
                return Err(format!("offering {i}: expected an object"));
            };
            fields_of(object).map_err(|e| format!("offering {i}: {e}"))
        })
        .collect()
}

fn fields_of(object: &serde_json::Map<String, Value>) -> Result<OfferingFields, String> {
    let get = |key: &str| object.get(key).filter(|v| !v.is_null());
    let string = |key: &'static str| -> Result<Option<String>, String> {
        match get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!("field {key}: expected a string, got {other}")),
        }
    };
    let boolean = |key: &'static str| -> Result<Option<bool>, String> {
        match get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(format!("field {key}: expected true or false, got {other}")),
        }
    };
    // An id may be written as a JSON number or a string.
    let id_or_text = |key: &'static str, v: &Value| -> Result<String, String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) if n.is_u64() => Ok(n.to_string()),
            other => Err(format!(
                "field {key}: expected a string or a whole number, got {other}"
            )),
        }
    };
    let list = |key: &'static str| -> Result<Option<Vec<String>>, String> {
        match get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| id_or_text(key, v))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(format!("field {key}: expected an array, got {other}")),
        }
    };
    let image = match get("image") {
        None => None,
        Some(v) => Some(id_or_text("image", v)?),
    };
    let tags = match get("tags") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(format!("field tags: expected strings, got {other}")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("field tags: expected an array, got {other}")),
    };
    Ok(OfferingFields {
        image,
        vpc_uuid: string("vpc_uuid")?,
        tags,
        ipv6: boolean("ipv6")?,
        monitoring: boolean("monitoring")?,
        ssh_keys: list("ssh_keys")?,
    })
}

/// Whether `tag` is a valid DigitalOcean tag name: 1 to 255 of letters, digits, `:`, `-`, `_`.
pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 255
        && tag
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b":-_".contains(&c))
}

/// Whether `tag` is one of the provider's own ownership tags (any case: DigitalOcean treats
/// tag names case-insensitively).
pub fn reserved_tag(tag: &str) -> bool {
    let lower = tag.to_ascii_lowercase();
    lower == MANAGED_TAG
        || [
            MACHINE_TAG_PREFIX,
            CLUSTER_TAG_PREFIX,
            PROVIDER_TAG_PREFIX,
            BOOTING_TAG_PREFIX,
        ]
        .iter()
        .any(|p| lower.starts_with(p))
}

/// Whether `text` has the 8-4-4-4-12 hexadecimal shape of a UUID.
pub fn valid_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// How a login key is named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyName {
    Id(u64),
    /// An MD5 fingerprint, `aa:bb:...` (16 bytes), as DigitalOcean shows them.
    Fingerprint(String),
    /// Anything else: the key's name in the account.
    Name(String),
}

pub fn key_name(text: &str) -> KeyName {
    if let Ok(id) = text.parse::<u64>() {
        return KeyName::Id(id);
    }
    let parts: Vec<&str> = text.split(':').collect();
    if parts.len() == 16
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|c| c.is_ascii_hexdigit()))
    {
        return KeyName::Fingerprint(text.to_ascii_lowercase());
    }
    KeyName::Name(text.to_owned())
}

/// Merges the flags and each offering's fields and checks everything that needs no API: tag
/// syntax and reserved tags, VPC UUID syntax, an image for every offering, and that offerings
/// of the same size and region do not ask for different settings. `require_image` is false
/// for the fake backend, which creates nothing.
pub fn plan(
    offerings: &[Offering],
    fields: &[OfferingFields],
    defaults: &Defaults,
    require_image: bool,
) -> Result<Vec<Wanted>, String> {
    let mut out: Vec<Wanted> = Vec::with_capacity(offerings.len());
    for (i, o) in offerings.iter().enumerate() {
        let f = fields.get(i).cloned().unwrap_or_default();
        let label = format!("{}/{}", o.instance_type, o.zone);
        let image = match f.image {
            Some(value) => Setting {
                value,
                from: Source::Field("image"),
            },
            None => Setting {
                value: defaults.image.clone(),
                from: Source::Flag("--image"),
            },
        };
        if require_image && image.value.trim().is_empty() {
            return Err(format!(
                "{}: an image is required (set --image or the offering's image field)",
                image.describe(&label)
            ));
        }
        let vpc_uuid = match f.vpc_uuid {
            Some(value) => Some(Setting {
                value,
                from: Source::Field("vpc_uuid"),
            }),
            None if !defaults.vpc_uuid.is_empty() => Some(Setting {
                value: defaults.vpc_uuid.clone(),
                from: Source::Flag("--vpc-uuid"),
            }),
            None => None,
        };
        if let Some(v) = &vpc_uuid
            && !valid_uuid(&v.value)
        {
            return Err(format!(
                "{}: not a VPC UUID (8-4-4-4-12 hexadecimal digits)",
                v.describe(&label)
            ));
        }
        let mut tags: Vec<Setting<String>> = Vec::new();
        let flag_tags = defaults.tags.iter().map(|t| (t, Source::Flag("--tag")));
        let own_tags = f.tags.iter().map(|t| (t, Source::Field("tags")));
        for (tag, from) in flag_tags.chain(own_tags) {
            let setting = Setting {
                value: tag.clone(),
                from,
            };
            if !valid_tag(tag) {
                return Err(format!(
                    "{}: not a DigitalOcean tag name (1 to 255 letters, digits, ':', '-' or '_')",
                    setting.describe(&label)
                ));
            }
            if reserved_tag(tag) {
                return Err(format!(
                    "{}: reserved for the provider's own ownership tags ({MANAGED_TAG}, \
                     {MACHINE_TAG_PREFIX}*, {PROVIDER_TAG_PREFIX}*, {CLUSTER_TAG_PREFIX}*, \
                     {BOOTING_TAG_PREFIX}*)",
                    setting.describe(&label)
                ));
            }
            if !tags
                .iter()
                .any(|t| t.value.eq_ignore_ascii_case(&setting.value))
            {
                tags.push(setting);
            }
        }
        let (keys, key_source) = match f.ssh_keys {
            Some(keys) => (keys, Source::Field("ssh_keys")),
            None => (defaults.ssh_keys.clone(), Source::Flag("--login-ssh-key")),
        };
        let mut ssh_keys: Vec<Setting<String>> = Vec::new();
        for key in keys {
            let setting = Setting {
                value: key,
                from: key_source,
            };
            if setting.value.trim().is_empty() {
                return Err(format!("{}: an empty SSH key", setting.describe(&label)));
            }
            if !ssh_keys.contains(&setting) {
                ssh_keys.push(setting);
            }
        }
        let wanted = Wanted {
            label,
            size: o.instance_type.clone(),
            region: o.zone.clone(),
            image,
            vpc_uuid,
            tags,
            ipv6: f.ipv6.unwrap_or(defaults.ipv6),
            monitoring: f.monitoring.unwrap_or(defaults.monitoring),
            ssh_keys,
        };
        if let Some(other) = out.iter().find(|w| w.label == wanted.label)
            && !same_settings(other, &wanted)
        {
            return Err(format!(
                "offering {}: two offerings of this size and region ask for different image, \
                 VPC, tags, ipv6, monitoring or ssh_keys; a Droplet of the size cannot tell \
                 them apart (merge them or make them the same)",
                wanted.label
            ));
        }
        out.push(wanted);
    }
    Ok(out)
}

fn same_settings(a: &Wanted, b: &Wanted) -> bool {
    let values = |s: &[Setting<String>]| s.iter().map(|t| t.value.clone()).collect::<Vec<_>>();
    a.image.value == b.image.value
        && a.vpc_uuid.as_ref().map(|v| &v.value) == b.vpc_uuid.as_ref().map(|v| &v.value)
        && values(&a.tags) == values(&b.tags)
        && a.ipv6 == b.ipv6
        && a.monitoring == b.monitoring
        && values(&a.ssh_keys) == values(&b.ssh_keys)
}

/// Resolves names and ids against the API, each distinct value once.
pub struct Resolver<'a> {
    api: &'a ApiClient,
    deadline: Instant,
    images: HashMap<String, Result<Image, String>>,
    private_images: Option<Result<Vec<Image>, String>>,
    vpcs: HashMap<String, Result<crate::api::Vpc, String>>,
    keys: HashMap<String, Result<SshKeyRef, String>>,
    key_list: Option<Result<Vec<crate::api::SshKey>, String>>,
}

fn api_problem(e: &ApiError) -> String {
    e.to_string()
}

impl<'a> Resolver<'a> {
    pub fn new(api: &'a ApiClient, deadline: Instant) -> Resolver<'a> {
        Resolver {
            api,
            deadline,
            images: HashMap::new(),
            private_images: None,
            vpcs: HashMap::new(),
            keys: HashMap::new(),
            key_list: None,
        }
    }

    /// The image a value names: a numeric id, a public image's slug, or the name of one of the
    /// account's snapshots or custom images (sent by its id).
    async fn find_image(&mut self, value: &str) -> Result<Image, String> {
        if let Some(found) = self.images.get(value) {
            return found.clone();
        }
        let found = self.lookup_image(value).await;
        self.images.insert(value.to_owned(), found.clone());
        found
    }

    async fn lookup_image(&mut self, value: &str) -> Result<Image, String> {
        if value.parse::<i64>().is_ok() {
            return match self.api.get_image(value, self.deadline).await {
                Ok(image) => Ok(image),
                Err(e) if e.is_not_found() => {
                    Err("no image, snapshot or custom image has this id".to_owned())
                }
                Err(e) => Err(api_problem(&e)),
            };
        }
        match self.api.get_image(value, self.deadline).await {
            Ok(image) if image.slug.as_deref() == Some(value) => return Ok(image),
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(api_problem(&e)),
        }
        if self.private_images.is_none() {
            let listed = self
                .api
                .list_private_images(self.deadline)
                .await
                .map_err(|e| api_problem(&e));
            self.private_images = Some(listed);
        }
        let own = self
            .private_images
            .clone()
            .unwrap_or_else(|| Ok(Vec::new()))?;
        let named: Vec<&Image> = own
            .iter()
            .filter(|i| i.name == value && (i.kind == "snapshot" || i.kind == "custom"))
            .collect();
        match named.as_slice() {
            [] => Err(
                "no public image has this slug and no snapshot or custom image of the account \
                 has this name"
                    .to_owned(),
            ),
            [one] => Ok((*one).clone()),
            many => Err(format!(
                "{} snapshots or custom images have this name (ids {}); name one by its id",
                many.len(),
                many.iter()
                    .map(|i| i.id.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// Resolves an image for `region`; the [`ImageRef`] a Create sends (a slug as configured,
    /// anything else by id) and a description of what was found.
    pub async fn image(&mut self, value: &str, region: &str) -> Result<(ImageRef, String), String> {
        let image = self.find_image(value).await?;
        if !image.status.is_empty() && image.status != "available" {
            return Err(format!(
                "image {} ({:?}) is {:?}, not available",
                image.id, image.name, image.status
            ));
        }
        if !image.regions.iter().any(|r| r == region) {
            return Err(format!(
                "image {} ({:?}) is not available in region {region} (it is in: {})",
                image.id,
                image.name,
                if image.regions.is_empty() {
                    "no region".to_owned()
                } else {
                    image.regions.join(", ")
                }
            ));
        }
        let kind = if image.kind.is_empty() {
            "image"
        } else {
            &image.kind
        };
        match image.slug.as_deref() {
            Some(slug) if slug == value => Ok((
                ImageRef::Slug(slug.to_owned()),
                format!("{kind} image {} ({:?})", image.id, image.name),
            )),
            _ => Ok((
                ImageRef::Id(image.id),
                format!("{kind} {} ({:?}), sent by id", image.id, image.name),
            )),
        }
    }

    /// Checks that the VPC exists and is in `region`.
    pub async fn vpc(&mut self, id: &str, region: &str) -> Result<String, String> {
        if !self.vpcs.contains_key(id) {
            let found = match self.api.get_vpc(id, self.deadline).await {
                Ok(vpc) => Ok(vpc),
                Err(e) if e.is_not_found() => Err("no VPC has this id".to_owned()),
                Err(e) => Err(api_problem(&e)),
            };
            self.vpcs.insert(id.to_owned(), found);
        }
        let vpc = self.vpcs[id].clone()?;
        if vpc.region != region {
            return Err(format!(
                "VPC {:?} is in region {}, not in the offering's region {region}",
                vpc.name, vpc.region
            ));
        }
        Ok(format!(
            "VPC {:?} {} in {}",
            vpc.name, vpc.ip_range, vpc.region
        ))
    }

    /// Resolves a login key: ids and fingerprints are checked to exist and sent as configured;
    /// a name is looked up in the account's keys and sent by id.
    pub async fn ssh_key(&mut self, value: &str) -> Result<SshKeyRef, String> {
        if let Some(found) = self.keys.get(value) {
            return found.clone();
        }
        let found = match key_name(value) {
            KeyName::Id(id) => self.get_key(value).await.map(|_| SshKeyRef::Id(id)),
            KeyName::Fingerprint(fp) => self.get_key(&fp).await.map(|_| SshKeyRef::Fingerprint(fp)),
            KeyName::Name(name) => {
                if self.key_list.is_none() {
                    let listed = self
                        .api
                        .list_ssh_keys(self.deadline)
                        .await
                        .map_err(|e| api_problem(&e));
                    self.key_list = Some(listed);
                }
                let keys = self.key_list.clone().unwrap_or_else(|| Ok(Vec::new()))?;
                let named: Vec<_> = keys.iter().filter(|k| k.name == name).collect();
                match named.as_slice() {
                    [] => {
                        Err("no SSH key of the account has this id, fingerprint or name".to_owned())
                    }
                    [one] => Ok(SshKeyRef::Id(one.id)),
                    many => Err(format!(
                        "{} SSH keys have this name; name one by id or fingerprint",
                        many.len()
                    )),
                }
            }
        };
        self.keys.insert(value.to_owned(), found.clone());
        found
    }

    async fn get_key(&self, key: &str) -> Result<(), String> {
        match self.api.get_ssh_key(key, self.deadline).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => {
                Err("no SSH key of the account has this id or fingerprint".to_owned())
            }
            Err(e) => Err(api_problem(&e)),
        }
    }

    /// Resolves every setting of `wanted`; the first problem fails, naming the offering, the
    /// field or flag and the value.
    pub async fn profile(&mut self, wanted: &Wanted) -> Result<DropletProfile, String> {
        let label = &wanted.label;
        let (image, _) = self
            .image(&wanted.image.value, &wanted.region)
            .await
            .map_err(|e| format!("{}: {e}", wanted.image.describe(label)))?;
        if let Some(vpc) = &wanted.vpc_uuid {
            self.vpc(&vpc.value, &wanted.region)
                .await
                .map_err(|e| format!("{}: {e}", vpc.describe(label)))?;
        }
        let mut ssh_keys = Vec::new();
        for key in &wanted.ssh_keys {
            let resolved = self
                .ssh_key(&key.value)
                .await
                .map_err(|e| format!("{}: {e}", key.describe(label)))?;
            if !ssh_keys.contains(&resolved) {
                ssh_keys.push(resolved);
            }
        }
        Ok(DropletProfile {
            image,
            vpc_uuid: wanted.vpc_uuid.as_ref().map(|v| v.value.clone()),
            tags: wanted.tags.iter().map(|t| t.value.clone()).collect(),
            ipv6: wanted.ipv6,
            monitoring: wanted.monitoring,
            ssh_keys,
        })
    }
}

/// The tags a Droplet of `wanted` carries that a firewall can select: the managed tag, the
/// provider tag and the extra tags (machine and cluster tags differ per Droplet).
pub fn selectable_tags(wanted: &Wanted, provider_tag: &str) -> BTreeSet<String> {
    let mut tags: BTreeSet<String> = wanted.tags.iter().map(|t| t.value.clone()).collect();
    tags.insert(MANAGED_TAG.to_owned());
    tags.insert(provider_tag.to_owned());
    tags
}

/// Whether `size` is sold in `region` with a price; what was found or the problem.
pub fn size_verdict(sizes: &[Size], size: &str, region: &str) -> Result<String, String> {
    let Some(found) = sizes.iter().find(|s| s.slug == size) else {
        return Err(format!("size {size:?} does not exist"));
    };
    if !found.available {
        return Err(format!("size {size:?} is not available for new Droplets"));
    }
    if !found.regions.iter().any(|r| r == region) {
        return Err(format!(
            "size {size:?} is not available in region {region} (it is in: {})",
            found.regions.join(", ")
        ));
    }
    if found.price_hourly <= 0.0 {
        return Err(format!("size {size:?} has no hourly price"));
    }
    Ok(format!(
        "{} vCPU, {} MiB, ${}/hour",
        found.vcpus, found.memory, found.price_hourly
    ))
}

/// The startup checks: token, sizes, and each offering's resolved settings, keyed by size.
pub async fn startup(
    api: &ApiClient,
    wanted: &[Wanted],
    deadline: Instant,
) -> Result<HashMap<String, DropletProfile>, String> {
    api.get_account(deadline).await.map_err(|e| match e.verdict() {
        // Rate limits, server errors and no answer until the budget ran out say nothing about
        // the token.
        Verdict::Retry { .. } => format!(
            "digitalocean: the API did not answer the startup checks (GET /v2/account) before their budget ran out: {e}"
        ),
        Verdict::Fatal => {
            format!("digitalocean: the API token does not work (GET /v2/account): {e}")
        }
    })?;
    let sizes = api
        .list_sizes(deadline)
        .await
        .map_err(|e| format!("digitalocean: list sizes: {e}"))?;
    // A size DigitalOcean does not sell in the region now is not a configuration problem: the
    // catalogue withdraws its offering and the others are served (its settings are resolved
    // at a later refresh, once it is sold again).
    let mut resolver = Resolver::new(api, deadline);
    let mut profiles = HashMap::new();
    for w in wanted {
        if let Err(why) = size_verdict(&sizes, &w.size, &w.region) {
            tracing::warn!(
                offering = w.label,
                why,
                "settings: an offering DigitalOcean does not sell now; the other offerings are served"
            );
            continue;
        }
        let profile = resolver.profile(w).await?;
        profiles.insert(w.size.clone(), profile);
    }
    Ok(profiles)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offering(size: &str) -> Offering {
        Offering {
            instance_type: size.into(),
            zone: "nyc3".into(),
            capacity_type: String::new(),
            count: 1,
            resources: Default::default(),
            labels: Default::default(),
        }
    }

    fn defaults() -> Defaults {
        Defaults {
            image: "ubuntu-24-04-x64".into(),
            ..Defaults::default()
        }
    }

    #[test]
    fn fields_parse_and_reference_files_stay_valid() {
        let plain =
            r#"[{"size": "s-2vcpu-4gb", "region": "nyc3", "count": 2, "resources": {"cpu": "2"}}]"#;
        assert_eq!(
            offering_fields(plain).unwrap(),
            vec![OfferingFields::default()]
        );
        let full = r#"[{"size": "s", "region": "nyc3", "image": 123, "vpc_uuid": "v",
            "tags": ["a", "b"], "ipv6": true, "monitoring": false, "ssh_keys": [7, "aa:bb", "ops"]}]"#;
        assert_eq!(
            offering_fields(full).unwrap(),
            vec![OfferingFields {
                image: Some("123".into()),
                vpc_uuid: Some("v".into()),
                tags: vec!["a".into(), "b".into()],
                ipv6: Some(true),
                monitoring: Some(false),
                ssh_keys: Some(vec!["7".into(), "aa:bb".into(), "ops".into()]),
            }]
        );
        let e = offering_fields(r#"[{}, {"ipv6": "yes"}]"#).unwrap_err();
        assert_eq!(
            e,
            "offering 1: field ipv6: expected true or false, got \"yes\""
        );
        let e = offering_fields(r#"[{"tags": "a,b"}]"#).unwrap_err();
        assert_eq!(e, "offering 0: field tags: expected an array, got \"a,b\"");
        let e = offering_fields(r#"[{"ssh_keys": [1.5]}]"#).unwrap_err();
        assert!(e.contains("field ssh_keys"), "{e}");
    }

    #[test]
    fn values_override_the_flags_and_tags_add_to_them() {
        let defaults = Defaults {
            image: "ubuntu-24-04-x64".into(),
            vpc_uuid: "5a4981aa-9653-4bd1-bef5-d6bff52042e4".into(),
            tags: vec!["k8s".into()],
            ipv6: true,
            monitoring: false,
            ssh_keys: vec!["ops".into()],
        };
        let fields = vec![
            OfferingFields::default(),
            OfferingFields {
                image: Some("node-snap".into()),
                vpc_uuid: Some("00000000-0000-4000-8000-000000000001".into()),
                tags: vec!["pool-b".into(), "K8S".into()],
                ipv6: Some(false),
                monitoring: Some(true),
                ssh_keys: Some(vec![]),
            },
        ];
        let plan = plan(&[offering("a"), offering("b")], &fields, &defaults, true).unwrap();
        assert_eq!(plan[0].image.from, Source::Flag("--image"));
        assert_eq!(
            plan[0].vpc_uuid.as_ref().unwrap().from,
            Source::Flag("--vpc-uuid")
        );
        assert_eq!(plan[0].tags.len(), 1);
        assert!(plan[0].ipv6 && !plan[0].monitoring);
        assert_eq!(plan[0].ssh_keys[0].value, "ops");
        assert_eq!(plan[1].image.value, "node-snap");
        assert_eq!(plan[1].image.from, Source::Field("image"));
        let tags: Vec<&str> = plan[1].tags.iter().map(|t| t.value.as_str()).collect();
        assert_eq!(
            tags,
            ["k8s", "pool-b"],
            "a tag differing only in case is one tag"
        );
        assert!(!plan[1].ipv6 && plan[1].monitoring);
        assert!(plan[1].ssh_keys.is_empty());
    }

    #[test]
    fn offline_errors_name_offering_field_and_value() {
        let bad = |fields: OfferingFields, defaults: Defaults| {
            plan(&[offering("s-2vcpu-4gb")], &[fields], &defaults, true).unwrap_err()
        };
        let e = bad(
            OfferingFields {
                tags: vec!["bad tag".into()],
                ..Default::default()
            },
            defaults(),
        );
        assert!(
            e.starts_with(
                "offering s-2vcpu-4gb/nyc3 field tags \"bad tag\": not a DigitalOcean tag name"
            ),
            "{e}"
        );
        let e = bad(
            OfferingFields::default(),
            Defaults {
                tags: vec!["bigfleet-managed".into()],
                ..defaults()
            },
        );
        assert!(
            e.starts_with("offering s-2vcpu-4gb/nyc3 --tag \"bigfleet-managed\": reserved"),
            "{e}"
        );
        let e = bad(
            OfferingFields {
                tags: vec!["BFMID:abc".into()],
                ..Default::default()
            },
            defaults(),
        );
        assert!(e.contains("field tags \"BFMID:abc\": reserved"), "{e}");
        let e = bad(
            OfferingFields {
                vpc_uuid: Some("vpc-prod".into()),
                ..Default::default()
            },
            defaults(),
        );
        assert_eq!(
            e,
            "offering s-2vcpu-4gb/nyc3 field vpc_uuid \"vpc-prod\": not a VPC UUID (8-4-4-4-12 hexadecimal digits)"
        );
        let e = bad(OfferingFields::default(), Defaults::default());
        assert!(
            e.starts_with("offering s-2vcpu-4gb/nyc3 --image \"\": an image is required"),
            "{e}"
        );
        let e = bad(
            OfferingFields {
                ssh_keys: Some(vec![" ".into()]),
                ..Default::default()
            },
            defaults(),
        );
        assert!(e.contains("field ssh_keys \" \": an empty SSH key"), "{e}");
        // Two offerings of one size and region must agree.
        let e = plan(
            &[offering("s"), offering("s")],
            &[
                OfferingFields::default(),
                OfferingFields {
                    ipv6: Some(true),
                    ..Default::default()
                },
            ],
            &defaults(),
            true,
        )
        .unwrap_err();
        assert!(e.starts_with("offering s/nyc3: two offerings"), "{e}");
        assert!(plan(&[offering("s")], &[], &Defaults::default(), false).is_ok());
    }

    #[test]
    fn syntax_helpers() {
        assert!(valid_uuid("5a4981aa-9653-4bd1-bef5-d6bff52042e4"));
        assert!(!valid_uuid("5a4981aa-9653-4bd1-bef5-d6bff52042e"));
        assert!(!valid_uuid("5a4981aa96534bd1bef5d6bff52042e4"));
        assert!(valid_tag("k8s:node-pool_1"));
        assert!(!valid_tag("a/b") && !valid_tag("") && !valid_tag(&"x".repeat(256)));
        assert!(reserved_tag("bigfleet-managed") && reserved_tag("bfprov:abc"));
        assert!(!reserved_tag("bigfleet-managed-pool") && !reserved_tag("k8s"));
        assert_eq!(key_name("512189"), KeyName::Id(512_189));
        assert_eq!(
            key_name("3B:16:BF:E4:8B:00:8B:B8:59:8C:A9:D3:F0:19:45:FA"),
            KeyName::Fingerprint("3b:16:bf:e4:8b:00:8b:b8:59:8c:a9:d3:f0:19:45:fa".into())
        );
        assert_eq!(key_name("ops laptop"), KeyName::Name("ops laptop".into()));
    }
}
