//! Shard identity under mTLS (`provider_core::identity`): a mutation is admitted only from a
//! client certificate whose one `bigfleet://` URI SAN is `bigfleet://shard/<shard_id>`, checked
//! before the fence; reads are open to every verified certificate. The client certificates come
//! from a CA generated here (rcgen); the server keeps the committed server certificate.

use std::path::PathBuf;

use fleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use provider_core::OperationKind;
use provider_core::identity::ShardIdentity;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::harness::{self, SETTLE, TestBackend, TestServer, machine_id, pki};
use crate::wire::{self, Caller, Shard, acked, state_of};

/// The shard the test client certificates are issued to.
const SHARD: &str = "rc-shard";
/// The shard the refused requests assert.
const OTHER: &str = "other-shard";

/// A client CA generated for one test, written where the server reads `--tls-ca`.
struct ClientCa {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
}

impl ClientCa {
    fn new() -> ClientCa {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "identity test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), cert.pem()).unwrap();
        ClientCa {
            dir,
            issuer: Issuer::new(params, key),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A ClientAuth certificate with these SANs (`uri:` entries are URIs, the rest DNS names).
    fn client(&self, names: &[&str]) -> Identity {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "identity test client");
        for name in names {
            params
                .subject_alt_names
                .push(match name.strip_prefix("uri:") {
                    Some(uri) => SanType::URI(uri.try_into().unwrap()),
                    None => SanType::DnsName((*name).try_into().unwrap()),
                });
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Identity::from_pem(cert.pem(), key.serialize_pem())
    }
}

/// A connected client presenting `identity`, trusting the committed CA for the server.
async fn client_as(server: &TestServer, identity: Identity) -> CapacityProviderClient<Channel> {
    let tls = ClientTlsConfig::new()
        .domain_name("localhost")
        .ca_certificate(Certificate::from_pem(
            std::fs::read(pki().join("ca.pem")).unwrap(),
        ))
        .identity(identity);
    let channel = Endpoint::from_shared(format!("https://{}", server.addr))
        .unwrap()
        .timeout(wire::RPC_TIMEOUT)
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    CapacityProviderClient::new(channel)
}

type Token = (String, i64, i64);

fn token(shard: &str, epoch: i64, sequence: i64) -> Token {
    (shard.to_owned(), epoch, sequence)
}

/// One mutation of `kind` on `id` with `token`.
async fn mutate(
    client: &mut CapacityProviderClient<Channel>,
    kind: OperationKind,
    id: &str,
    token: Token,
) -> Result<pb::TransitionAck, tonic::Status> {
    let reply = match kind {
        OperationKind::Create => client.create(wire::create_request(id, token)).await,
        OperationKind::Configure => {
            client
                .configure(wire::configure_request(id, "c", Default::default(), token))
                .await
        }
        OperationKind::Drain => client.drain(wire::drain_request(id, token)).await,
        OperationKind::Delete => client.delete(wire::delete_request(id, token)).await,
    };
    reply.map(tonic::Response::into_inner)
}

const KINDS: [OperationKind; 4] = [
    OperationKind::Create,
    OperationKind::Configure,
    OperationKind::Drain,
    OperationKind::Delete,
];

/// `bigfleet_it_shard_identity_rejected_total{reason}` now.
/// A client with the certificate of the shard `SHARD`.
async fn shard_client(server: &TestServer, ca: &ClientCa) -> CapacityProviderClient<Channel> {
    client_as(
        server,
        ca.client(&[&format!("uri:bigfleet://shard/{SHARD}")]),
    )
    .await
}

/// Under `mode`, a Create from the shard `SHARD`'s certificate with the token of the shard
/// `OTHER`: its answer, and how many mismatches were counted meanwhile.
async fn create_under_another_shards_token(
    ca: &ClientCa,
    mode: ShardIdentity,
) -> (Result<pb::TransitionAck, tonic::Status>, f64) {
    let server = harness::start_mtls(TestBackend::instant(2), &ca.path(), Some(mode)).await;
    let before = rejected("mismatch");
    let mut client = shard_client(&server, ca).await;
    let token = token(OTHER, 1, 1);
    let answer = mutate(&mut client, OperationKind::Create, &machine_id(0), token).await;
    let counted = rejected("mismatch") - before;
    server.stop().await;
    (answer, counted)
}

fn rejected(reason: &str) -> f64 {
    let name = format!("bigfleet_it_shard_identity_rejected_total{{reason=\"{reason}\"}} ");
    provider_core::telemetry::recorder()
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&name).and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_certificate_of_the_asserted_shard_is_admitted_for_every_mutation() {
    let ca = ClientCa::new();
    let server = harness::start_mtls(TestBackend::instant(1), &ca.path(), None).await;
    let client = shard_client(&server, &ca).await;
    let mut caller = Caller {
        client,
        shard: Shard::new(SHARD, 1),
    };
    let id = machine_id(0);
    caller.create(&id).await.expect("Create");
    caller
        .wait_for_state(&id, pb::MachineState::Idle, SETTLE)
        .await
        .unwrap();
    caller
        .configure(&id, "c", Default::default())
        .await
        .expect("Configure");
    caller
        .wait_for_state(&id, pb::MachineState::Configured, SETTLE)
        .await
        .unwrap();
    caller.drain(&id).await.expect("Drain");
    caller
        .wait_for_state(&id, pb::MachineState::Idle, SETTLE)
        .await
        .unwrap();
    caller.delete(&id).await.expect("Delete");
    caller
        .wait_for_state(&id, pb::MachineState::Speculative, SETTLE)
        .await
        .unwrap();
    server.stop().await;
}

/// Every certificate that does not prove the asserted shard is refused, for every mutation,
/// with PERMISSION_DENIED naming what it carries and the shard asserted, before the fence: the
/// asserted shard's mark does not move (a later token below the refused ones is accepted), and
/// whether the machine exists is not revealed.
#[tokio::test]
async fn certificates_that_do_not_prove_the_shard_are_refused_before_the_fence() {
    let _ = provider_core::telemetry::recorder();
    let ca = ClientCa::new();
    let backend = TestBackend::instant(1);
    let server = harness::start_mtls(backend.clone(), &ca.path(), None).await;
    let id = machine_id(0);
    let own = format!("uri:bigfleet://shard/{SHARD}");
    let other = format!("uri:bigfleet://shard/{OTHER}");
    // (certificate SANs, reason, what the message says was found)
    let cases: [(Vec<&str>, &str, &str); 5] = [
        (vec![&own], "mismatch", "\"bigfleet://shard/rc-shard\""),
        (vec![], "missing", "(none)"),
        (
            vec![&own, &other],
            "multiple",
            "(\"bigfleet://shard/rc-shard\", \"bigfleet://shard/other-shard\")",
        ),
        (vec!["shard.example.com"], "missing", "(none)"),
        (
            vec!["uri:bigfleet://admin"],
            "mismatch",
            "\"bigfleet://admin\"",
        ),
    ];
    let before: Vec<f64> = ["mismatch", "missing", "multiple"]
        .iter()
        .map(|r| rejected(r))
        .collect();
    let mut sequence = 100;
    for (names, _, found) in &cases {
        let mut client = client_as(&server, ca.client(names)).await;
        for kind in KINDS {
            for target in [id.as_str(), "ghost"] {
                sequence += 1;
                let status = mutate(&mut client, kind, target, token(OTHER, 5, sequence))
                    .await
                    .expect_err("refused");
                assert_eq!(
                    status.code(),
                    Code::PermissionDenied,
                    "{names:?} {kind:?}: {status:?}"
                );
                assert!(
                    status.message().contains(found)
                        && status.message().contains("shard_id \"other-shard\""),
                    "{names:?} {kind:?}: {}",
                    status.message()
                );
            }
        }
    }
    for (i, reason) in ["mismatch", "missing", "multiple"].iter().enumerate() {
        let want = cases.iter().filter(|(_, r, _)| r == reason).count() * KINDS.len() * 2;
        assert_eq!(rejected(reason) - before[i], want as f64, "{reason}");
    }
    assert_eq!(backend.calls(OperationKind::Create), 0);
    // The shard's own certificate: (5, 1) is below every refused token, so it is accepted only
    // if none of them moved the mark.
    let mut shard = client_as(&server, ca.client(&[&other])).await;
    let ack = mutate(&mut shard, OperationKind::Create, &id, token(OTHER, 5, 1))
        .await
        .expect("the refused tokens never reached the fence");
    assert_eq!(state_of(acked(&ack)), pb::MachineState::Creating);
    server.stop().await;
}

#[tokio::test]
async fn warn_admits_and_counts_and_off_admits_without_counting() {
    let _ = provider_core::telemetry::recorder();
    let ca = ClientCa::new();
    let (answer, counted) = create_under_another_shards_token(&ca, ShardIdentity::Warn).await;
    let ack = answer.expect("warn admits");
    assert_eq!(state_of(acked(&ack)), pb::MachineState::Creating);
    assert_eq!(counted, 1.0);

    let (answer, counted) = create_under_another_shards_token(&ca, ShardIdentity::Off).await;
    answer.expect("off admits");
    assert_eq!(counted, 0.0, "off does not check");
}

#[tokio::test]
async fn reads_pass_for_an_admin_certificate_and_its_mutations_do_not() {
    let ca = ClientCa::new();
    let server = harness::start_mtls(TestBackend::instant(2), &ca.path(), None).await;
    let mut admin = Caller {
        client: client_as(&server, ca.client(&["uri:bigfleet://admin"])).await,
        shard: Shard::new(SHARD, 1),
    };
    let machine = admin.get(&machine_id(0)).await.expect("Get");
    assert_eq!(state_of(&machine), pb::MachineState::Speculative);
    assert_eq!(admin.list_all().await.expect("List").len(), 2);
    let status = admin.create(&machine_id(0)).await.expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    server.stop().await;
}

/// The zero token (the in-process bypass of fencing) asserts the shard "": only
/// `bigfleet://shard/` proves it.
#[tokio::test]
async fn the_zero_token_gets_no_exemption() {
    let ca = ClientCa::new();
    let server = harness::start_mtls(TestBackend::instant(2), &ca.path(), None).await;
    let (id, zero) = (machine_id(0), token("", 0, 0));
    let mut shard = shard_client(&server, &ca).await;
    let status = mutate(&mut shard, OperationKind::Create, &id, zero.clone())
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status.message().contains("shard_id \"\""),
        "{}",
        status.message()
    );
    let mut empty = client_as(&server, ca.client(&["uri:bigfleet://shard/"])).await;
    mutate(&mut empty, OperationKind::Create, &id, zero)
        .await
        .expect("bigfleet://shard/ proves the empty shard id");
    server.stop().await;
}
