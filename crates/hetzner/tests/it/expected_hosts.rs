//! What the out-of-band check expects: a server the cloud named for a Create is expected from
//! that moment, also when the Create fails afterwards (a boot that outlasts its deadline), so
//! such a server can never hide a server deleted behind the provider's back from the count.

use provider_core::cloud::{Cloud, InventorySignal};

use crate::harness::{Env, ctx};

#[tokio::test]
async fn a_failed_creates_server_does_not_hide_a_server_deleted_out_of_band() {
    let env = Env::without_ssh().await;
    env.emulator.set_polls_to_running(0);
    let first = env
        .cloud
        .create_host(&env.machine("cx23", "nbg1", 0), &ctx(30))
        .await
        .unwrap();
    env.cloud
        .create_host(&env.machine("cx23", "nbg1", 1), &ctx(30))
        .await
        .unwrap();
    // A survey: the two servers are what the check expects.
    assert_eq!(env.cloud.list_hosts().await.unwrap().len(), 2);
    assert!(matches!(
        env.cloud.inventory_changed().await.unwrap(),
        InventorySignal::Unchanged
    ));

    // A Create whose server never comes up within its deadline: the Create fails, the
    // server exists (the machine keeps it, FAILED) and is expected.
    env.emulator.set_polls_to_running(u32::MAX);
    let failed = env
        .cloud
        .create_host(&env.machine("cx23", "nbg1", 2), &ctx(1))
        .await
        .unwrap_err();
    assert!(failed.0.contains("deadline exceeded"), "{}", failed.0);
    assert_eq!(env.emulator.live_servers().len(), 3);
    assert!(
        matches!(
            env.cloud.inventory_changed().await.unwrap(),
            InventorySignal::Unchanged
        ),
        "the failed Create's server is expected: no change"
    );

    // A server deleted in the console: two servers carry the label where three are expected.
    assert!(env.emulator.delete_out_of_band(first.id.parse().unwrap()));
    let signal = env.cloud.inventory_changed().await.unwrap();
    assert!(
        matches!(&signal, InventorySignal::Changed { why } if why.contains("2 servers")),
        "{signal:?}"
    );
}
