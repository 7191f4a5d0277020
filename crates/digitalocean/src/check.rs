//! The DigitalOcean half of `digitalocean check` (the subset that runs at startup of the real
//! backend is [`crate::profile::startup`]). Only read calls: `GET /v2/account`,
//! `/v2/droplets?per_page=1` (the Droplet limit's headroom), `/v2/regions`, `/v2/sizes`,
//! `/v2/images/{id or slug}` (and `/v2/images?private=true` for snapshot names), `/v2/vpcs/{id}`,
//! `/v2/account/keys[/{id or fingerprint}]` and `/v2/firewalls`. No message carries the API
//! token or the bootstrap secret.

use provider_core::check::Report;
use tokio::time::Instant;

use crate::api::{ApiClient, Firewall};
use crate::naming::provider_tag;
use crate::profile::{Resolver, Wanted, selectable_tags, size_verdict};
use crate::setup::{RealFlags, agent_pin, load_channel_tls};

/// The Droplet limit's headroom: the account's `droplet_limit` less the Droplets it has, against
/// the slots this provider offers. A problem when the offered slots cannot all be created.
fn droplet_headroom(limit: u64, used: u64, offered: u64) -> Result<String, String> {
    let headroom = limit.saturating_sub(used);
    let found = format!(
        "{used} of {limit} Droplets in use, room for {headroom} more; the offerings have {offered} slots"
    );
    if offered > headroom {
        Err(format!(
            "{found}: {} of them cannot be created until the limit is raised or Droplets are deleted",
            offered - headroom
        ))
    } else {
        Ok(found)
    }
}

/// Every API check of `check`, one line each.
pub async fn api_checks(
    report: &mut Report,
    api: &ApiClient,
    wanted: &[Wanted],
    offered_slots: u64,
    provider: &str,
    deadline: Instant,
) {
    report.progress("the API token");
    match api.get_account(deadline).await {
        Ok(account) if account.status == "active" || account.status.is_empty() => {
            report.ok(
                "token",
                format!(
                    "account {} active, Droplet limit {}",
                    account.uuid, account.droplet_limit
                ),
            );
            report.progress("the Droplet limit");
            match api.count_droplets(deadline).await {
                Ok(used) => report.record(
                    "droplet limit",
                    droplet_headroom(account.droplet_limit, used, offered_slots),
                ),
                Err(e) => report.problem("droplet limit", format!("count Droplets: {e}")),
            }
        }
        Ok(account) => report.problem(
            "token",
            format!(
                "the account is {:?}: {}",
                account.status, account.status_message
            ),
        ),
        Err(e) => {
            // Without a working token no other API check can say anything.
            report.problem("token", format!("GET /v2/account failed: {e}"));
            return;
        }
    }
    report.progress("regions and sizes");
    let regions = api.list_regions(deadline).await;
    let sizes = api.list_sizes(deadline).await;
    for w in wanted {
        let check = format!("offering {} region", w.label);
        match &regions {
            Ok(regions) => match regions.iter().find(|r| r.slug == w.region) {
                Some(r) if r.available => report.ok(check, format!("{} available", r.slug)),
                Some(r) => {
                    report.problem(check, format!("region {:?} takes no new Droplets", r.slug))
                }
                None => report.problem(check, format!("region {:?} does not exist", w.region)),
            },
            Err(e) => report.problem(check, format!("list regions: {e}")),
        }
        let check = format!("offering {} size", w.label);
        match &sizes {
            Ok(sizes) => report.record(check, size_verdict(sizes, &w.size, &w.region)),
            Err(e) => report.problem(check, format!("list sizes: {e}")),
        }
    }
    let mut resolver = Resolver::new(api, deadline);
    for w in wanted {
        report.progress(&format!("offering {} image", w.label));
        let image = resolver.image(&w.image.value, &w.region).await;
        report.record(
            format!("offering {} image", w.label),
            image
                .map(|(_, found)| found)
                .map_err(|e| format!("{}: {e}", w.image.describe(&w.label))),
        );
        if let Some(vpc) = &w.vpc_uuid {
            report.progress(&format!("offering {} VPC", w.label));
            let found = resolver.vpc(&vpc.value, &w.region).await;
            report.record(
                format!("offering {} vpc_uuid", w.label),
                found.map_err(|e| format!("{}: {e}", vpc.describe(&w.label))),
            );
        }
        for key in &w.ssh_keys {
            report.progress(&format!("offering {} SSH keys", w.label));
            let found = resolver.ssh_key(&key.value).await;
            report.record(
                format!("offering {} ssh_keys {:?}", w.label, key.value),
                found
                    .map(|k| match k {
                        crate::api::SshKeyRef::Id(id) => format!("key {id}, sent by id"),
                        crate::api::SshKeyRef::Fingerprint(fp) => {
                            format!("key {fp}, sent by fingerprint")
                        }
                    })
                    .map_err(|e| format!("{}: {e}", key.describe(&w.label))),
            );
        }
    }
    report.progress("cloud firewalls");
    let firewalls = api.list_firewalls(deadline).await;
    let own = provider_tag(provider);
    for w in wanted {
        let check = format!("offering {} firewalls", w.label);
        match &firewalls {
            Ok(all) => report.ok(check, firewalls_selecting(all, w, &own)),
            Err(e) => report.problem(check, format!("list firewalls: {e}")),
        }
    }
}

/// Which firewalls select the Droplets of `w` by one of their tags, as a line.
pub fn firewalls_selecting(all: &[Firewall], w: &Wanted, provider_tag: &str) -> String {
    let tags = selectable_tags(w, provider_tag);
    let selecting: Vec<String> = all
        .iter()
        .filter_map(|f| {
            let by: Vec<&str> = f
                .tags
                .iter()
                .filter(|t| tags.iter().any(|o| o.eq_ignore_ascii_case(t)))
                .map(String::as_str)
                .collect();
            (!by.is_empty()).then(|| format!("{:?} (by tag {})", f.name, by.join(", ")))
        })
        .collect();
    let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
    if selecting.is_empty() {
        format!(
            "no cloud firewall selects the tags {} (Droplets get none by tag)",
            tags.join(", ")
        )
    } else {
        format!(
            "{} select the tags {}",
            selecting.join(", "),
            tags.join(", ")
        )
    }
}

/// The bootstrap checks: the HMAC secret is set, the channel's certificate and key load and
/// match, `--bootstrap-ca` parses, and the agents will accept the channel's certificate for the
/// host of `--bootstrap-endpoint` (a VPC address is fine as long as the certificate names it).
pub fn bootstrap_checks(report: &mut Report, flags: &RealFlags) {
    report.progress("bootstrap material");
    let secret_len = flags.bootstrap_secret.trim().len();
    if secret_len == 0 {
        report.problem(
            "--bootstrap-secret",
            "not set (--bootstrap-secret or BIGFLEET_BOOTSTRAP_SECRET)",
        );
    } else if secret_len < 32 {
        report.ok(
            "--bootstrap-secret",
            format!("set, {secret_len} bytes (32 or more recommended)"),
        );
    } else {
        report.ok("--bootstrap-secret", format!("set, {secret_len} bytes"));
    }
    if flags.bootstrap_addr.is_empty() {
        report.problem("--bootstrap-addr", "not set");
    } else {
        report.ok("--bootstrap-addr", flags.bootstrap_addr.clone());
    }
    if flags.bootstrap_tls_cert.is_empty() || flags.bootstrap_tls_key.is_empty() {
        report.problem(
            "--bootstrap-tls-cert/--bootstrap-tls-key",
            "both are required (the bootstrap blob travels over TLS)",
        );
        return;
    }
    let tls = load_channel_tls(&flags.bootstrap_tls_cert, &flags.bootstrap_tls_key)
        .map(|_| format!("{} and its key match", flags.bootstrap_tls_cert));
    let tls_ok = tls.is_ok();
    report.record("--bootstrap-tls-cert/--bootstrap-tls-key", tls);
    if !tls_ok {
        return;
    }
    let pin = agent_pin(flags);
    if !flags.bootstrap_ca.is_empty() {
        report.record(
            "--bootstrap-ca",
            pin.as_ref()
                .map(|_| format!("{} parses", flags.bootstrap_ca))
                .map_err(Clone::clone),
        );
    }
    let Ok(pin) = pin else {
        return;
    };
    let endpoint = &flags.bootstrap_endpoint;
    let https = reqwest::Url::parse(endpoint)
        .is_ok_and(|u| u.scheme() == "https" && u.host_str().is_some_and(|h| !h.is_empty()));
    if !https {
        report.problem(
            "--bootstrap-endpoint",
            format!("{endpoint:?} must be an https:// URL the agents can reach"),
        );
        return;
    }
    report.record(
        "--bootstrap-endpoint",
        pin.verified_for(endpoint).map(|_| {
            format!("{endpoint}: the agents accept the channel's certificate for this host")
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Size;

    fn size(slug: &str, regions: &[&str], price: f64, available: bool) -> Size {
        Size {
            slug: slug.into(),
            memory: 4096,
            vcpus: 2,
            disk: 80,
            price_hourly: price,
            available,
            regions: regions.iter().map(|r| (*r).to_owned()).collect(),
        }
    }

    #[test]
    fn sizes_must_exist_be_sold_in_the_region_and_have_a_price() {
        let sizes = [
            size("s-2vcpu-4gb", &["nyc3", "sfo3"], 0.03571, true),
            size("s-old", &["nyc3"], 0.01, false),
            size("s-free", &["nyc3"], 0.0, true),
        ];
        assert_eq!(
            size_verdict(&sizes, "s-2vcpu-4gb", "nyc3").unwrap(),
            "2 vCPU, 4096 MiB, $0.03571/hour"
        );
        assert_eq!(
            size_verdict(&sizes, "s-2vcpu-4gb", "ams3").unwrap_err(),
            "size \"s-2vcpu-4gb\" is not available in region ams3 (it is in: nyc3, sfo3)"
        );
        assert!(
            size_verdict(&sizes, "s-9", "nyc3")
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(
            size_verdict(&sizes, "s-old", "nyc3")
                .unwrap_err()
                .contains("not available")
        );
        assert!(
            size_verdict(&sizes, "s-free", "nyc3")
                .unwrap_err()
                .contains("no hourly price")
        );
    }

    #[test]
    fn the_droplet_limit_must_leave_room_for_every_slot() {
        assert_eq!(
            droplet_headroom(25, 5, 16),
            Ok("5 of 25 Droplets in use, room for 20 more; the offerings have 16 slots".into())
        );
        assert_eq!(
            droplet_headroom(25, 20, 16),
            Err(
                "20 of 25 Droplets in use, room for 5 more; the offerings have 16 slots: 11 of \
                 them cannot be created until the limit is raised or Droplets are deleted"
                    .into()
            )
        );
        assert!(droplet_headroom(3, 9, 1).is_err(), "over the limit already");
    }
}
