//! The gRPC port in its three security modes (insecure, TLS, mTLS) with the committed test PKI:
//! who gets through, that refusals happen in the TLS layer before any handler runs, TLS 1.3
//! only, and the health and reflection services beside CapacityProvider.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use provider_core::OperationKind;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ProtocolVersion, RootCertStore, SupportedProtocolVersion};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

use crate::harness::{self, ServerSecurity, TestBackend, TestServer, machine_id, pki};
use crate::wire::{self, Caller, ClientSecurity, Shard, acked, state_of};
use fleet_proto::v1alpha1 as pb;

/// Asks the server for its services over reflection (v1).
async fn reflected_services(server: &TestServer) -> Vec<String> {
    let channel = server.channel(server.security.client()).await;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection call")
        .into_inner();
    let reply = replies
        .message()
        .await
        .expect("reflection reply")
        .expect("one reply");
    match reply.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("want a service list, got {other:?}"),
    }
}

/// Health of "" and of the CapacityProvider service, and a Get that reaches the engine.
async fn serves(server: &TestServer, security: ClientSecurity) {
    let channel = server.channel(security).await;
    for service in ["", fleet_proto::SERVICE_NAME] {
        assert_eq!(
            wire::health(&channel, service).await.expect("health"),
            ServingStatus::Serving,
            "health of {service:?} over {security:?}"
        );
    }
    let mut caller = Caller::new(channel, Shard::new("s", 1));
    let machine = caller.get(&machine_id(0)).await.expect("Get");
    assert_eq!(state_of(&machine), pb::MachineState::Speculative);
    // A status a handler sent is never mistaken for a transport refusal.
    let status = caller.get("ghost").await.expect_err("unknown id");
    assert_eq!(status.code(), Code::NotFound);
    assert!(!wire::is_transport_refusal(&status), "{status:?}");
}

/// The client is refused in the transport: either it cannot connect, or its first call fails
/// with a client-side transport error (never a status from a server handler).
async fn refused(server: &TestServer, security: ClientSecurity) {
    let Ok(channel) = wire::channel(&pki(), server.addr, security).await else {
        return;
    };
    let mut caller = Caller::new(channel.clone(), Shard::new("s", 1));
    match wire::health(&channel, "").await {
        Err(status) => assert!(
            wire::is_transport_refusal(&status),
            "{security:?}: want a transport refusal, got {status:?}"
        ),
        Ok(status) => panic!("{security:?} client got a health answer: {status:?}"),
    }
    match caller.get(&machine_id(0)).await {
        Err(status) => assert!(
            wire::is_transport_refusal(&status),
            "{security:?}: want a transport refusal, got {status:?}"
        ),
        Ok(machine) => panic!("{security:?} client got a machine: {machine:?}"),
    }
}

/// The server's reflection lists each of `wanted`.
async fn assert_reflected(server: &TestServer, wanted: &[&str]) {
    let services = reflected_services(server).await;
    for wanted in wanted {
        assert!(
            services.iter().any(|s| s == wanted),
            "{wanted} not in {services:?}"
        );
    }
}

#[tokio::test]
async fn insecure_serves_plaintext_with_health_and_reflection() {
    let server = harness::start(TestBackend::instant(2), ServerSecurity::Insecure).await;
    serves(&server, ClientSecurity::Plaintext).await;
    refused(&server, ClientSecurity::Tls).await;
    assert_reflected(
        &server,
        &[fleet_proto::SERVICE_NAME, "grpc.health.v1.Health"],
    )
    .await;
    server.stop().await;
}

#[tokio::test]
async fn tls_serves_clients_that_trust_the_ca() {
    let server = harness::start(TestBackend::instant(2), ServerSecurity::Tls).await;
    serves(&server, ClientSecurity::Tls).await;
    // A certificate offered to a server that does not ask for one changes nothing.
    serves(&server, ClientSecurity::Mtls).await;
    refused(&server, ClientSecurity::Plaintext).await;
    // The server proves itself with the test CA's certificate, nothing else.
    refused(&server, ClientSecurity::TlsOtherRoots).await;
    assert_reflected(&server, &[fleet_proto::SERVICE_NAME]).await;
    server.stop().await;
}

#[tokio::test]
async fn mtls_serves_clients_with_a_certificate_of_the_ca() {
    let server = harness::start(TestBackend::instant(2), ServerSecurity::Mtls).await;
    serves(&server, ClientSecurity::Mtls).await;
    assert_reflected(&server, &[fleet_proto::SERVICE_NAME]).await;
    server.stop().await;
}

/// A refused client's mutation never reaches the engine: its fence token is still fresh
/// afterwards and the backend was never called.
#[tokio::test]
async fn mtls_refuses_missing_and_foreign_client_certificates_before_any_handler() {
    let backend = TestBackend::instant(2);
    let server = harness::start(backend.clone(), ServerSecurity::Mtls).await;
    let id = machine_id(0);
    for security in [
        ClientSecurity::Tls,
        ClientSecurity::MtlsOtherCa,
        ClientSecurity::Plaintext,
    ] {
        refused(&server, security).await;
        if let Ok(channel) = wire::channel(&pki(), server.addr, security).await {
            let mut zombie = Caller::new(channel, Shard::new(wire::TEST_SHARD, 1));
            let status = zombie
                .create(&id)
                .await
                .expect_err("a refused client's Create");
            assert!(
                wire::is_transport_refusal(&status),
                "{security:?}: {status:?}"
            );
        }
    }
    assert_eq!(backend.calls(OperationKind::Create), 0);
    // The same token (shard, 1, 1) the refused clients sent is accepted from a good client.
    let mut good = Caller::new(
        server.channel(ClientSecurity::Mtls).await,
        Shard::new(wire::TEST_SHARD, 1),
    );
    let ack = good.create(&id).await.expect("the token was never seen");
    assert_eq!(state_of(acked(&ack)), pb::MachineState::Creating);
    server.stop().await;
}

fn pem_certs(name: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(pki().join(name))
        .expect("read PEM")
        .collect::<Result<_, _>>()
        .expect("parse PEM")
}

/// A raw rustls client trusting the test CA, limited to `versions`, offering ALPN h2.
fn raw_client(
    versions: &[&'static SupportedProtocolVersion],
    identity: Option<(&str, &str)>,
) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    for cert in pem_certs("ca.pem") {
        roots.add(cert).expect("CA cert");
    }
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(versions)
            .expect("versions")
            .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                pem_certs(cert),
                PrivateKeyDer::from_pem_file(pki().join(key)).expect("key"),
            )
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

async fn handshake(addr: SocketAddr, config: ClientConfig) -> io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
}

/// Reads the server's first bytes after the handshake: its HTTP/2 SETTINGS frame (an h2 server
/// speaks first) when the connection was accepted, a TLS alert when it was not.
async fn first_bytes(mut stream: TlsStream<TcpStream>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 64];
    let n = stream.read(&mut buf).await?;
    buf.truncate(n);
    Ok(buf)
}

#[tokio::test]
async fn mtls_refusal_is_a_tls_alert() {
    let server = harness::start(TestBackend::instant(1), ServerSecurity::Mtls).await;
    let tls13: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13];

    // With the CA's client certificate: TLS 1.3, h2, and the server speaks HTTP/2.
    let stream = handshake(
        server.addr,
        raw_client(tls13, Some(("client.pem", "client-key.pem"))),
    )
    .await
    .expect("handshake with a good client certificate");
    let (_, session) = stream.get_ref();
    assert_eq!(session.protocol_version(), Some(ProtocolVersion::TLSv1_3));
    assert_eq!(session.alpn_protocol(), Some(&b"h2"[..]));
    let settings = first_bytes(stream).await.expect("HTTP/2 answer");
    assert_eq!(
        settings.get(3),
        Some(&0x4),
        "want a SETTINGS frame, got {settings:?}"
    );

    // In TLS 1.3 the client finishes its side first; the server's verdict arrives as an alert.
    for (identity, alert) in [
        (None, "CertificateRequired"),
        (
            Some(("other-client.pem", "other-client-key.pem")),
            "UnknownCA",
        ),
    ] {
        let outcome = match handshake(server.addr, raw_client(tls13, identity)).await {
            Ok(stream) => first_bytes(stream).await,
            Err(e) => Err(e),
        };
        let err = outcome.expect_err("the server must refuse this client");
        assert!(
            err.to_string().contains(alert),
            "{identity:?}: want alert {alert}, got {err}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn tls12_only_clients_are_refused() {
    for security in [ServerSecurity::Tls, ServerSecurity::Mtls] {
        let server = harness::start(TestBackend::instant(1), security).await;
        let identity = Some(("client.pem", "client-key.pem"));
        let err = handshake(
            server.addr,
            raw_client(&[&rustls::version::TLS12], identity),
        )
        .await
        .expect_err("a TLS 1.2-only client must not complete a handshake");
        assert!(
            err.to_string().contains("ProtocolVersion"),
            "{security:?}: want a protocol_version alert, got {err}"
        );
        // The same client allowed TLS 1.3 gets through.
        let stream = handshake(
            server.addr,
            raw_client(
                &[&rustls::version::TLS12, &rustls::version::TLS13],
                identity,
            ),
        )
        .await
        .expect("TLS 1.3 handshake");
        assert_eq!(
            stream.get_ref().1.protocol_version(),
            Some(ProtocolVersion::TLSv1_3)
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn health_follows_the_reporter() {
    let server = harness::start(TestBackend::instant(1), ServerSecurity::Insecure).await;
    let channel = server.channel(ClientSecurity::Plaintext).await;
    assert_eq!(
        wire::health(&channel, "").await.unwrap(),
        ServingStatus::Serving
    );
    server.health.set(false).await;
    for service in ["", fleet_proto::SERVICE_NAME] {
        assert_eq!(
            wire::health(&channel, service).await.unwrap(),
            ServingStatus::NotServing
        );
    }
    let unknown = wire::health(&channel, "no.such.Service").await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);
    server.stop().await;
}

#[tokio::test]
async fn reflection_can_be_turned_off() {
    let server =
        harness::start_with(TestBackend::instant(1), ServerSecurity::Insecure, false).await;
    let channel = server.channel(ClientSecurity::Plaintext).await;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let outcome = ServerReflectionClient::new(channel.clone())
        .server_reflection_info(tokio_stream::iter([request]))
        .await;
    assert_eq!(
        outcome.expect_err("no reflection service").code(),
        Code::Unimplemented
    );
    // Everything else still serves.
    assert_eq!(
        wire::health(&channel, "").await.unwrap(),
        ServingStatus::Serving
    );
    server.stop().await;
}
