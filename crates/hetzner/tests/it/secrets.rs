//! Secrets stay out of Debug output: the real backend's configuration prints neither the
//! token, nor the SSH private key, nor the operator's base user-data.

use hetzner::cloud::{HetznerConfig, Timing};
use hetzner::ssh::SshConfig;
use provider_core::config::Secret;
use provider_core::telemetry::Telemetry;
use russh::keys::ssh_key::LineEnding;

use crate::harness::new_key;

#[test]
fn the_config_debug_output_holds_no_user_data_token_or_key_material() {
    let key = new_key().to_openssh(LineEnding::LF).unwrap().to_string();
    let user_data =
        "#cloud-config\nwrite_files:\n- path: /etc/join\n  content: operator-secret-41f7\n";
    let config = HetznerConfig {
        token: Secret::new("hcloud-token-a9d3e2"),
        endpoint: "http://127.0.0.1:1/v1".into(),
        provider_instance: "hz".into(),
        server: hetzner::settings::ServerSpec {
            image: "ubuntu-24.04".into(),
            ..Default::default()
        },
        offerings: Vec::new(),
        locations: vec!["nbg1".into()],
        ssh: Some(SshConfig {
            user: "root".into(),
            key: key.clone(),
            port: 22,
        }),
        bootstrap_hook: "/opt/bigfleet/bootstrap".into(),
        base_user_data: Some(user_data.into()),
        readiness_command: None,
        eur_usd: 1.08,
        telemetry: Telemetry::new("bigfleet_hetzner_it_secrets"),
        timing: Timing::default(),
    };
    for text in [format!("{config:?}"), format!("{config:#?}")] {
        assert!(!text.contains("operator-secret-41f7"), "{text}");
        assert!(!text.contains("write_files"), "{text}");
        assert!(!text.contains("hcloud-token-a9d3e2"), "{text}");
        assert!(!text.contains("PRIVATE KEY"), "{text}");
        for line in key.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!text.contains(line), "key material leaked: {text}");
        }
        assert!(
            text.contains(&format!("[redacted; {} bytes]", user_data.len())),
            "{text}"
        );
        assert!(text.contains("ubuntu-24.04"), "the rest stays readable");
    }
}
