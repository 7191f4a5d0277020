//! `cargo xtask demo [hetzner|digitalocean]`: builds a provider, runs it on its fake backend on
//! loopback with mTLS, and drives one machine through its whole lifecycle over gRPC, printing
//! each state it passes through, then the error answers a shard would see.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fleet_proto::v1alpha1 as pb;

use crate::e2e::provider_process::{self, Spec};
use crate::e2e::wire::{self, Caller, ClientSecurity, Shard};
use crate::repo;

/// `cpu=8 memory=16Gi`, keys sorted; `-` when there are none.
fn resources_text(resources: &HashMap<String, String>) -> String {
    let mut pairs: Vec<_> = resources.iter().collect();
    pairs.sort();
    let text: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if text.is_empty() {
        "-".to_owned()
    } else {
        text.join(" ")
    }
}

/// A gRPC code as the gRPC documentation spells it (`FAILED_PRECONDITION`).
fn code_text(code: tonic::Code) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

fn show(step: &str, machine: &pb::Machine) {
    let state = wire::state_of(machine)
        .as_str_name()
        .trim_start_matches("MACHINE_STATE_");
    let host = machine
        .host
        .as_ref()
        .map(|h| format!("{}/{}", h.provider, h.r#ref))
        .unwrap_or_else(|| "-".into());
    let cluster = if machine.cluster.is_empty() {
        "-"
    } else {
        &machine.cluster
    };
    println!("  {step:<28} {state:<12} host={host:<24} cluster={cluster}");
}

pub fn run(args: &[String]) -> Result<()> {
    let binary = args.first().map(String::as_str).unwrap_or("hetzner");
    if !["hetzner", "digitalocean"].contains(&binary) {
        bail!("usage: cargo xtask demo [hetzner|digitalocean]");
    }
    let root = repo::root();
    let status = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["build", "--quiet", "-p", binary])
        .status()?;
    if !status.success() {
        bail!("cargo build -p {binary} failed");
    }
    let pki = wire::pki_dir(&root);
    let pem = |name: &str| pki.join(name).display().to_string();
    let spec = Spec {
        name: binary.to_owned(),
        binary: provider_process::target_binary(&root, "debug", binary),
        args: vec![
            "--use-fake-backend".into(),
            "--seed-count=8".into(),
            "--fake-latency=300ms".into(),
            format!("--tls-cert={}", pem("server.pem")),
            format!("--tls-key={}", pem("server-key.pem")),
            format!("--tls-ca={}", pem("ca.pem")),
        ],
        metrics: true,
        security: ClientSecurity::Mtls,
        pki: pki.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let provider = provider_process::start(spec).await?;
        let metrics = provider
            .metrics
            .map_or_else(|| "off".to_owned(), |addr| addr.to_string());
        println!(
            "{binary} is serving CapacityProvider on {} (mTLS), metrics on {metrics}",
            provider.grpc
        );
        let channel = wire::channel(&pki, provider.grpc, ClientSecurity::Mtls).await?;
        let mut caller = Caller::new(channel, Shard::new(wire::TEST_SHARD, 1));
        let machines = caller.list_all().await?;
        println!("inventory: {} machines, e.g.", machines.len());
        for m in machines.iter().take(3) {
            println!(
                "  {}  {}  {}  ${:.4}/h  allocatable: {}",
                m.id,
                m.instance_type,
                m.zone,
                m.price_per_hour,
                m.allocatable
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |a| resources_text(&a.resources))
            );
        }
        let id = machines
            .first()
            .context("the fake backend seeded no machine")?
            .id
            .clone();
        println!("lifecycle of {id}:");
        let settle = Duration::from_secs(10);
        show("Get", &caller.get(&id).await?);
        show("Create (ack)", wire::acked(&caller.create(&id).await?));
        show(
            "settled",
            &caller
                .wait_for_state(&id, pb::MachineState::Idle, settle)
                .await?,
        );
        let metadata = HashMap::from([("team".to_owned(), "demo".to_owned())]);
        show(
            "Configure (ack)",
            wire::acked(&caller.configure(&id, "cluster-a", metadata).await?),
        );
        show(
            "settled",
            &caller
                .wait_for_state(&id, pb::MachineState::Configured, settle)
                .await?,
        );
        show("Drain (ack)", wire::acked(&caller.drain(&id).await?));
        show(
            "settled",
            &caller
                .wait_for_state(&id, pb::MachineState::Idle, settle)
                .await?,
        );
        show("Delete (ack)", wire::acked(&caller.delete(&id).await?));
        show(
            "settled",
            &caller
                .wait_for_state(&id, pb::MachineState::Speculative, settle)
                .await?,
        );
        println!("what a shard sees when it gets things wrong:");
        let stale = caller
            .client
            .create(wire::create_request(&id, (wire::TEST_SHARD.into(), 1, 1)))
            .await;
        if let Err(status) = stale {
            println!(
                "  stale fence token  -> {}: {}",
                code_text(status.code()),
                status.message()
            );
        }
        let impostor = caller
            .client
            .create(wire::create_request(&id, ("another-shard".into(), 1, 1)))
            .await;
        if let Err(status) = impostor {
            println!(
                "  another shard's id  -> {}: {}",
                code_text(status.code()),
                status.message()
            );
        }
        let wrong = caller.drain(&id).await;
        if let Err(status) = wrong {
            println!(
                "  drain a Speculative -> {}: {}",
                code_text(status.code()),
                status.message()
            );
        }
        let unknown = caller.get("no-such-machine").await;
        if let Err(status) = unknown {
            println!(
                "  unknown machine    -> {}: {}",
                code_text(status.code()),
                status.message()
            );
        }
        provider.terminate()?;
        println!("stopped {binary} with SIGTERM");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_demo_prints_is_read_by_people() {
        let resources = HashMap::from([
            ("memory".to_owned(), "16Gi".to_owned()),
            ("cpu".to_owned(), "8".to_owned()),
        ]);
        assert_eq!(resources_text(&resources), "cpu=8 memory=16Gi");
        assert_eq!(resources_text(&HashMap::new()), "-");
        assert_eq!(
            code_text(tonic::Code::FailedPrecondition),
            "FAILED_PRECONDITION"
        );
        assert_eq!(code_text(tonic::Code::NotFound), "NOT_FOUND");
        assert_eq!(code_text(tonic::Code::Internal), "INTERNAL");
    }
}
