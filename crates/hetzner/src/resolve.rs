//! Resolution of an offering's settings against the API, once (at startup, on first use, or in
//! `hetzner check`): server type and architecture, location, price and availability, the image
//! (by name or ID, or the newest match of a label selector for the type's architecture),
//! networks and subnets, firewalls and login SSH keys. The result, a [`Plan`], is everything a
//! Create sends; nothing here runs per Create.
//!
//! Each item is reported to a sink as one check line (`offering cx22/nbg1 image`, ...) with
//! what was found or the problem, naming the flag or offering field and the value. Startup
//! fails on the first problems; `hetzner check` prints every line.

use std::collections::{BTreeMap, HashMap};

use crate::models;
use tokio::time::Instant;

use crate::api::{ApiError, HcloudApi};
use crate::settings::{OfferingSpec, Placement, SshAddress};

/// One offering's settings, resolved to the IDs a Create sends.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// `cx22/nbg1`.
    pub key: String,
    pub server_type: String,
    pub location: String,
    pub architecture: models::Architecture,
    pub image: i64,
    /// Networks joined at create time (`networks` of the create request).
    pub create_networks: Vec<i64>,
    /// Networks joined right after create in a chosen subnet (`attach_to_network`).
    pub attach: Vec<(i64, String)>,
    /// The network whose address SSH uses with `ssh_address` private (the first listed).
    pub ssh_network: Option<i64>,
    pub firewalls: Vec<i64>,
    pub public_ipv4: bool,
    pub public_ipv6: bool,
    pub ssh_address: SshAddress,
    pub spread: bool,
    pub labels: BTreeMap<String, String>,
    /// Login SSH key IDs, as the create request takes them.
    pub login_keys: Vec<String>,
}

/// Where the check lines of a resolution go.
pub trait Sink: Send {
    fn line(&mut self, check: String, result: Result<String, String>);
    fn progress(&mut self, _what: &str) {}
    /// An offering the cloud does not sell now (its type is unknown, not sold in its location,
    /// past its deprecation date or temporarily unavailable there). Not a configuration
    /// problem: the provider serves the other offerings and advertises this one again when
    /// the catalogue says it can be ordered. Reported as a problem line by default.
    fn withdrawn(&mut self, check: String, why: String) {
        self.line(check, Err(why));
    }
}

/// Collects the problems only (startup), and apart from them why offerings are withdrawn.
#[derive(Default)]
pub struct Problems(pub Vec<String>, pub Vec<String>);

impl Sink for Problems {
    fn line(&mut self, _check: String, result: Result<String, String>) {
        if let Err(problem) = result {
            self.0.push(problem);
        }
    }

    /// Startup serves the other offerings: the catalogue withdraws this one.
    fn withdrawn(&mut self, _check: String, why: String) {
        self.1.push(why);
    }
}

fn arch_name(arch: models::Architecture) -> &'static str {
    match arch {
        models::Architecture::Arm => "arm",
        models::Architecture::X86 => "x86",
        models::Architecture::Unknown => "an unknown architecture",
    }
}

fn api_text(e: &ApiError) -> String {
    match e {
        ApiError::Status { status: 401, .. } => {
            "the API rejected the token (HTTP 401 unauthorized; check --token / HCLOUD_TOKEN)"
                .into()
        }
        other => other.to_string(),
    }
}

/// Resolves names once per run, whichever offering names them.
pub struct Resolver<'a> {
    api: &'a HcloudApi,
    deadline: Instant,
    networks: HashMap<String, Result<models::Network, String>>,
    firewalls: HashMap<String, Result<i64, String>>,
    keys: HashMap<String, Result<i64, String>>,
    types: HashMap<String, Result<Option<models::ServerType>, String>>,
    locations: HashMap<String, Result<Option<models::Location>, String>>,
}

impl<'a> Resolver<'a> {
    pub fn new(api: &'a HcloudApi, deadline: Instant) -> Resolver<'a> {
        Resolver {
            api,
            deadline,
            networks: HashMap::new(),
            firewalls: HashMap::new(),
            keys: HashMap::new(),
            types: HashMap::new(),
            locations: HashMap::new(),
        }
    }

    async fn server_type(&mut self, name: &str) -> Result<Option<models::ServerType>, String> {
        if let Some(hit) = self.types.get(name) {
            return hit.clone();
        }
        let found = self
            .api
            .server_type(name, Some(self.deadline))
            .await
            .map_err(|e| api_text(&e));
        self.types.insert(name.to_owned(), found.clone());
        found
    }

    async fn location(&mut self, name: &str) -> Result<Option<models::Location>, String> {
        if let Some(hit) = self.locations.get(name) {
            return hit.clone();
        }
        let found = self
            .api
            .location(name, Some(self.deadline))
            .await
            .map_err(|e| api_text(&e));
        self.locations.insert(name.to_owned(), found.clone());
        found
    }

    async fn network(&mut self, name: &str) -> Result<models::Network, String> {
        if let Some(hit) = self.networks.get(name) {
            return hit.clone();
        }
        let found = match self.api.network(name, Some(self.deadline)).await {
            Ok(Some(n)) => Ok(n),
            Ok(None) => Err(format!("network {name:?} does not exist")),
            Err(e) => Err(format!("look up network {name:?}: {}", api_text(&e))),
        };
        self.networks.insert(name.to_owned(), found.clone());
        found
    }

    async fn firewall(&mut self, name: &str) -> Result<i64, String> {
        if let Some(hit) = self.firewalls.get(name) {
            return hit.clone();
        }
        let found = match self.api.firewall(name, Some(self.deadline)).await {
            Ok(Some(f)) => Ok(f.id),
            Ok(None) => Err(format!("firewall {name:?} does not exist")),
            Err(e) => Err(format!("look up firewall {name:?}: {}", api_text(&e))),
        };
        self.firewalls.insert(name.to_owned(), found.clone());
        found
    }

    async fn ssh_key(&mut self, name: &str) -> Result<i64, String> {
        if let Some(hit) = self.keys.get(name) {
            return hit.clone();
        }
        let found = match self.api.ssh_key(name, Some(self.deadline)).await {
            Ok(Some(k)) => Ok(k.id),
            Ok(None) => Err(format!("SSH key {name:?} does not exist")),
            Err(e) => Err(format!("look up SSH key {name:?}: {}", api_text(&e))),
        };
        self.keys.insert(name.to_owned(), found.clone());
        found
    }

    /// Resolves one offering, reporting every item to `sink`; `None` when any item failed.
    pub async fn resolve(&mut self, spec: &OfferingSpec, sink: &mut dyn Sink) -> Option<Plan> {
        let key = spec.key();
        let s = &spec.spec;
        let mut ok = true;
        sink.progress(&format!("offering {key}"));
        // Server type.
        let kind = match self.server_type(&spec.server_type).await {
            Ok(Some(kind)) => {
                sink.line(
                    format!("offering {key} server_type"),
                    Ok(format!(
                        "{} ({}, {} vCPU, {} GB, {} GB disk)",
                        kind.name,
                        arch_name(kind.architecture),
                        kind.cores,
                        kind.memory,
                        kind.disk
                    )),
                );
                Some(kind)
            }
            Ok(None) => {
                sink.withdrawn(
                    format!("offering {key} server_type"),
                    format!(
                        "offering {key} server_type {:?} does not exist (the API lists no such \
                         server type): withdrawn",
                        spec.server_type
                    ),
                );
                None
            }
            Err(e) => {
                sink.line(
                    format!("offering {key} server_type"),
                    Err(format!(
                        "offering {key} server_type {:?}: {e}",
                        spec.server_type
                    )),
                );
                None
            }
        };
        // Location, price and availability.
        let location = self.location(&spec.location).await;
        let location_line = match (&location, &kind) {
            (Ok(None), _) => Err(format!(
                "offering {key} location {:?} does not exist",
                spec.location
            )),
            (Err(e), _) => Err(format!("offering {key} location {:?}: {e}", spec.location)),
            (Ok(Some(_)), None) => Ok("exists".to_owned()),
            (Ok(Some(l)), Some(kind)) => {
                let (found, withdrawn) = availability(kind, l, &key);
                if let Some(why) = withdrawn {
                    sink.withdrawn(format!("offering {key} availability"), why);
                }
                Ok(found)
            }
        };
        ok &= location_line.is_ok() && kind.is_some();
        sink.line(format!("offering {key} location"), location_line);
        // Image.
        let image = match &kind {
            Some(kind) => {
                let image = self.image(spec, kind.architecture).await;
                let line = image
                    .as_ref()
                    .map(|(id, what)| format!("{what} (id {id})"))
                    .map_err(Clone::clone);
                sink.line(format!("offering {key} image"), line);
                image.ok().map(|(id, _)| id)
            }
            None => None,
        };
        ok &= image.is_some();
        // Networks and subnets.
        let mut create_networks = Vec::new();
        let mut attach = Vec::new();
        let mut ssh_network = None;
        if !s.networks.is_empty() {
            let zone = location
                .as_ref()
                .ok()
                .and_then(|l| l.as_ref())
                .map(|l| l.network_zone.clone());
            let mut found = Vec::new();
            let mut problems = Vec::new();
            for n in &s.networks {
                match self.network(&n.network).await {
                    Ok(network) => {
                        if ssh_network.is_none() {
                            ssh_network = Some(network.id);
                        }
                        match &n.subnet {
                            None => {
                                create_networks.push(network.id);
                                found.push(format!("{} ({})", network.name, network.id));
                            }
                            Some(range) => {
                                let subnet = network
                                    .subnets
                                    .iter()
                                    .find(|sub| sub.ip_range.as_deref() == Some(range.as_str()));
                                match subnet {
                                    None => problems.push(format!(
                                        "network {:?} has no subnet {range}",
                                        n.network
                                    )),
                                    Some(sub)
                                        if zone
                                            .as_ref()
                                            .is_some_and(|z| *z != sub.network_zone) =>
                                    {
                                        problems.push(format!(
                                            "subnet {range} of network {:?} is in network zone \
                                             {}, not in {} of location {}",
                                            n.network,
                                            sub.network_zone,
                                            zone.clone().unwrap_or_default(),
                                            spec.location
                                        ))
                                    }
                                    Some(_) => {
                                        attach.push((network.id, range.clone()));
                                        found.push(format!(
                                            "{} ({}) subnet {range}",
                                            network.name, network.id
                                        ));
                                    }
                                }
                            }
                        }
                    }
                    Err(e) => problems.push(e),
                }
            }
            let line = if problems.is_empty() {
                Ok(found.join(", "))
            } else {
                Err(format!(
                    "{}: {}",
                    spec.source("networks"),
                    problems.join("; ")
                ))
            };
            ok &= line.is_ok();
            sink.line(format!("offering {key} networks"), line);
        }
        // Firewalls.
        let mut firewalls = Vec::new();
        if !s.firewalls.is_empty() {
            let mut problems = Vec::new();
            for f in &s.firewalls {
                match self.firewall(f).await {
                    Ok(id) => firewalls.push(id),
                    Err(e) => problems.push(e),
                }
            }
            let line = if problems.is_empty() {
                Ok(format!("{} ({firewalls:?})", s.firewalls.join(", ")))
            } else {
                Err(format!(
                    "{}: {}",
                    spec.source("firewalls"),
                    problems.join("; ")
                ))
            };
            ok &= line.is_ok();
            sink.line(format!("offering {key} firewalls"), line);
        }
        // Login keys.
        let mut login_keys = Vec::new();
        if !s.login_keys.is_empty() {
            let mut problems = Vec::new();
            for k in &s.login_keys {
                match self.ssh_key(k).await {
                    Ok(id) => login_keys.push(id.to_string()),
                    Err(e) => problems.push(e),
                }
            }
            let line = if problems.is_empty() {
                Ok(format!(
                    "{} ({})",
                    s.login_keys.join(", "),
                    login_keys.join(", ")
                ))
            } else {
                Err(format!(
                    "{}: {}",
                    spec.source("login_ssh_keys"),
                    problems.join("; ")
                ))
            };
            ok &= line.is_ok();
            sink.line(format!("offering {key} login_ssh_keys"), line);
        }
        let (kind, image) = match (kind, image) {
            (Some(kind), Some(image)) if ok => (kind, image),
            _ => return None,
        };
        Some(Plan {
            key,
            server_type: kind.name.clone(),
            location: spec.location.clone(),
            architecture: kind.architecture,
            image,
            create_networks,
            attach,
            ssh_network,
            firewalls,
            public_ipv4: s.public_ipv4,
            public_ipv6: s.public_ipv6,
            ssh_address: s.ssh_address,
            spread: s.placement == Placement::Spread,
            labels: s.labels.clone(),
            login_keys,
        })
    }

    /// The image of an offering for `arch`: `(id, description)`.
    async fn image(
        &mut self,
        spec: &OfferingSpec,
        arch: models::Architecture,
    ) -> Result<(i64, String), String> {
        let key = spec.key();
        let s = &spec.spec;
        if !s.image_selector.is_empty() {
            let source = spec.source("image_selector");
            let images = self
                .api
                .images_by_selector(&s.image_selector, arch, Some(self.deadline))
                .await
                .map_err(|e| format!("{source} {:?}: {}", s.image_selector, api_text(&e)))?;
            // Newest first by creation time (RFC 3339 sorts as text), then the higher id.
            let newest = images
                .iter()
                .max_by(|a, b| a.created.cmp(&b.created).then(a.id.cmp(&b.id)))
                .ok_or_else(|| {
                    format!(
                        "{source} {:?}: no available image or snapshot matches it for \
                         architecture {} (server type {} of offering {key}); refusing to \
                         create servers of this offering",
                        s.image_selector,
                        arch_name(arch),
                        spec.server_type
                    )
                })?;
            let kind = match newest.r#type {
                models::image::Type::Snapshot => "snapshot",
                models::image::Type::System => "system image",
                models::image::Type::App => "app image",
                models::image::Type::Backup => "backup",
                models::image::Type::Unknown => "image",
            };
            return Ok((
                newest.id,
                format!(
                    "newest {kind} matching {:?} for {}: {} created {}",
                    s.image_selector,
                    arch_name(arch),
                    newest.name.as_deref().unwrap_or(&newest.description),
                    newest.created
                ),
            ));
        }
        let source = spec.source("image");
        match self.api.image(&s.image, arch, Some(self.deadline)).await {
            Ok(Some(image)) if image.architecture != arch => Err(format!(
                "{source} {:?} is built for {}, but server type {} is {}",
                s.image,
                arch_name(image.architecture),
                spec.server_type,
                arch_name(arch)
            )),
            Ok(Some(image)) => Ok((
                image.id,
                format!(
                    "{} for {}",
                    image.name.as_deref().unwrap_or(&image.description),
                    arch_name(arch)
                ),
            )),
            Ok(None) => Err(format!(
                "{source} {:?} does not exist for architecture {} (server type {})",
                s.image,
                arch_name(arch),
                spec.server_type
            )),
            Err(e) => Err(format!("{source} {:?}: {}", s.image, api_text(&e))),
        }
    }
}

/// Where the server type stands in the location: what was found, and why it cannot be
/// ordered there now (`None` when it can).
fn availability(
    kind: &models::ServerType,
    location: &models::Location,
    key: &str,
) -> (String, Option<String>) {
    let net = kind
        .prices
        .iter()
        .find(|p| p.location == location.name)
        .map(|p| format!("net {} EUR/h", p.price_hourly.net.trim()))
        .unwrap_or_else(|| "no price".to_owned());
    let place = format!("{} ({}), {net}", location.name, location.network_zone);
    let standing = crate::catalog::standing(kind, &location.name);
    let now = provider_core::catalogue::now_unix();
    if let Some(why) = standing.withdrawn_at(now) {
        return (
            format!("{place}; withdrawn: {why}"),
            Some(format!(
                "offering {key}: {why}: withdrawn (the provider serves the other offerings and \
                 advertises this one again when Hetzner sells it there)"
            )),
        );
    }
    match &standing.deprecation {
        Some(d) => (
            format!(
                "{place}; deprecated (announced {}), unavailable after {}: choose a successor before then",
                d.announced, d.unavailable_after
            ),
            None,
        ),
        None => (format!("{place}, orderable"), None),
    }
}
