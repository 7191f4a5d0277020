//! Startup validation of the real backend's flags (`hetzner::real::build`).

use std::io::Write;

use hetzner::real::{RealArgs, build};
use provider_core::config::Secret;
use provider_core::machine::StringMap;
use provider_core::offerings::Offering;
use provider_core::telemetry::Telemetry;

use crate::harness::real_args;

fn args() -> RealArgs {
    real_args("https://api.hetzner.cloud/v1", "t0k3n-for-build-tests")
}

fn offerings() -> Vec<Offering> {
    vec![Offering {
        instance_type: "cx23".into(),
        zone: "nbg1".into(),
        capacity_type: String::new(),
        count: 1,
        resources: StringMap::new(),
        labels: StringMap::new(),
    }]
}

fn error(args: RealArgs) -> String {
    build(args, &offerings(), Telemetry::new("bigfleet_hetzner_it"))
        .err()
        .expect("build fails")
}

#[test]
fn required_flags() {
    assert!(build(args(), &offerings(), Telemetry::new("bigfleet_hetzner_it")).is_ok());
    assert_eq!(
        error(RealArgs {
            token: Secret::new(""),
            ..args()
        }),
        "hcloud: token is required for the hetzner backend"
    );
    assert_eq!(
        error(RealArgs {
            image: String::new(),
            ..args()
        }),
        "hcloud: --image is required for the hetzner backend (or --image-selector, or an image per offering)"
    );
    let err = error(RealArgs {
        endpoint: "http://mirror.example.com/v1".into(),
        ..args()
    });
    assert!(
        err.contains("plain http is only allowed for loopback"),
        "{err}"
    );
    assert!(
        build(
            RealArgs {
                endpoint: "http://127.0.0.1:8080/v1".into(),
                ..args()
            },
            &offerings(),
            Telemetry::new("bigfleet_hetzner_it")
        )
        .is_ok()
    );
}

#[test]
fn ssh_key_errors_name_the_file() {
    let err = error(RealArgs {
        ssh_key: "/nonexistent/id_ed25519".into(),
        ..args()
    });
    assert!(
        err.starts_with("read --ssh-key /nonexistent/id_ed25519: "),
        "{err}"
    );
    let mut bad = tempfile::NamedTempFile::new().unwrap();
    bad.write_all(
        b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----\n",
    )
    .unwrap();
    let path = bad.path().to_str().unwrap().to_owned();
    let err = error(RealArgs {
        ssh_key: path.clone(),
        ..args()
    });
    assert!(
        err.starts_with(&format!("parse --ssh-key {path}: ")),
        "{err}"
    );
    let mut good = tempfile::NamedTempFile::new().unwrap();
    let key = crate::harness::new_key();
    good.write_all(
        key.to_openssh(russh::keys::ssh_key::LineEnding::LF)
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    let ok = build(
        RealArgs {
            ssh_key: good.path().to_str().unwrap().into(),
            ..args()
        },
        &offerings(),
        Telemetry::new("bigfleet_hetzner_it"),
    );
    assert!(ok.is_ok());
}

#[test]
fn private_ssh_needs_a_network() {
    let err = error(RealArgs {
        ssh_address: "private".into(),
        ..args()
    });
    assert_eq!(
        err,
        "offering cx23/nbg1 --ssh-address \"private\" needs a private network, but offering cx23/nbg1 --network is empty"
    );
    let err = error(RealArgs {
        ssh_address: "bastion".into(),
        ..args()
    });
    assert_eq!(
        err,
        "--ssh-address must be public, private or ipv6 (got \"bastion\")"
    );
    let ok = build(
        RealArgs {
            ssh_address: "private".into(),
            networks: vec!["mgmt".into()],
            ..args()
        },
        &offerings(),
        Telemetry::new("bigfleet_hetzner_it"),
    );
    assert!(ok.is_ok());
}

#[test]
fn base_user_data_must_be_readable() {
    let err = error(RealArgs {
        base_user_data: "/nonexistent/cloud-init".into(),
        ..args()
    });
    assert!(
        err.starts_with("read --base-user-data: /nonexistent/cloud-init: "),
        "{err}"
    );
}

#[test]
fn production_settings_are_validated_with_flag_and_value() {
    let cases: Vec<(RealArgs, &str)> = vec![
        (
            RealArgs {
                image_selector: "role=node".into(),
                ..args()
            },
            "set either --image (\"ubuntu-24.04\") or --image-selector (\"role=node\"), not both",
        ),
        (
            RealArgs {
                image: String::new(),
                image_selector: "role".into(),
                ..args()
            },
            "--image-selector \"role\": \"role\" is not key=value",
        ),
        (
            RealArgs {
                networks: vec!["mgmt=10.0.1.0".into()],
                ..args()
            },
            "--network \"mgmt=10.0.1.0\": subnet \"10.0.1.0\" is not an IPv4 range like 10.0.1.0/24",
        ),
        (
            RealArgs {
                server_labels: vec!["bigfleet-managed=false".into()],
                ..args()
            },
            "--server-label label key \"bigfleet-managed\" is reserved",
        ),
        (
            RealArgs {
                server_labels: vec!["team=a b".into()],
                ..args()
            },
            "--server-label label value \"a b\" (key \"team\") is not a Hetzner label value",
        ),
        (
            RealArgs {
                placement: "pack".into(),
                ..args()
            },
            "--placement must be none or spread (got \"pack\")",
        ),
        (
            RealArgs {
                public_ipv6: false,
                ssh_address: "ipv6".into(),
                ..args()
            },
            "offering cx23/nbg1 --ssh-address \"ipv6\" needs a public IPv6, but offering cx23/nbg1 --public-ipv6 is false",
        ),
    ];
    for (args, want) in cases {
        let err = error(args);
        assert!(err.starts_with(want), "want {want:?}, got {err:?}");
        assert!(!err.contains("t0k3n"), "{err}");
    }
}

#[test]
fn an_offering_field_is_named_in_its_error() {
    let overrides = hetzner::settings::parse_overrides(
        r#"[{"server_type":"cx23","location":"nbg1","public_ipv4":false}]"#,
    )
    .unwrap();
    let err = error(RealArgs {
        overrides,
        ..args()
    });
    assert_eq!(
        err,
        "offering cx23/nbg1 --ssh-address \"public\" needs a public IPv4, but offering cx23/nbg1 field \"public_ipv4\" is false (use \"private\" with a network or \"ipv6\")"
    );
}
