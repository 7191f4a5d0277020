//! The resolved Droplet settings kept beside a local state (`profiles.json`), against the
//! emulator: the real backend built from its flags as the binary builds it, then resolved as
//! before any port binds. A restart for the same settings, endpoint and token makes no API call
//! at all and Creates send the saved settings; another setting, endpoint or token, or a corrupt
//! file, looks up from the API; a refresh that fails keeps the settings in use, one that finds
//! them changed installs and saves them. The binary's own restart and refresh cadence close it.

use std::path::PathBuf;
use std::time::Duration;

use digitalocean::profile::{Defaults, Wanted, offering_fields, plan};
use do_emulator::{Emulator, Fault};
use provider_core::cloud::Cloud;
use provider_core::offerings::Offering;
use serde_json::{Value, json};
use testkit::digitalocean::RunningEmulator;

use crate::binary::{Provider, Site};
use crate::support::*;

const SIZE: &str = "s-2vcpu-4gb";
const SNAPSHOT: &str = "k8s-node";

/// An emulator serving on 127.0.0.1, its URL, and what stops it.
async fn serve_emulator() -> (Emulator, String, RunningEmulator) {
    let serving = RunningEmulator::start(API_TOKEN).await;
    (serving.emulator.clone(), serving.url.clone(), serving)
}

/// An account with the snapshot and the login key the offering names.
fn seed(emulator: &Emulator) -> (u64, u64) {
    let snapshot = emulator.add_snapshot(SNAPSHOT, &[REGION]);
    let (key, _) = emulator.add_ssh_key("ops");
    (snapshot, key)
}

/// The one offering, its image a snapshot name, its login key a key name, with `tags`.
fn wanted(tags: &[&str]) -> Vec<Wanted> {
    let offering = Offering {
        instance_type: SIZE.into(),
        zone: REGION.into(),
        capacity_type: String::new(),
        count: 2,
        resources: Default::default(),
        labels: Default::default(),
    };
    let fields = offering_fields(
        &json!([{
            "size": SIZE, "region": REGION, "image": SNAPSHOT, "ssh_keys": ["ops"], "tags": tags
        }])
        .to_string(),
    )
    .unwrap();
    let defaults = Defaults {
        image: "ubuntu-24-04-x64".into(),
        ..Defaults::default()
    };
    plan(&[offering], &fields, &defaults, true).unwrap()
}

/// An emulated account and the files of a provider on a local state.
struct Rig {
    emulator: Emulator,
    api_url: String,
    dir: tempfile::TempDir,
    pki: Pki,
    _stop: RunningEmulator,
}

impl Rig {
    async fn start() -> Rig {
        let (emulator, api_url, stop) = serve_emulator().await;
        Rig {
            emulator,
            api_url,
            dir: tempfile::tempdir().unwrap(),
            pki: pki(),
            _stop: stop,
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn file(&self) -> PathBuf {
        self.state().join(digitalocean::profile_cache::FILE_NAME)
    }

    fn saved(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.file()).expect("profiles.json")).unwrap()
    }

    /// The real backend's flags, as the binary passes them.
    fn flags(&self) -> digitalocean::RealFlags {
        let file = |name: &str, body: &str| write_file(self.dir.path(), name, body);
        digitalocean::RealFlags {
            provider: PROVIDER.into(),
            token: zeroize::Zeroizing::new(API_TOKEN.into()),
            region: REGION.into(),
            image: "ubuntu-24-04-x64".into(),
            api_url: self.api_url.clone(),
            bootstrap_addr: "127.0.0.1:0".into(),
            bootstrap_endpoint: "https://127.0.0.1:9443".into(),
            bootstrap_tls_cert: file("channel.pem", &self.pki.cert_pem),
            bootstrap_tls_key: file("channel-key.pem", &self.pki.key_pem),
            bootstrap_ca: file("ca.pem", &self.pki.ca_pem),
            bootstrap_secret: zeroize::Zeroizing::new(SECRET.repeat(2)),
            state: self.state().display().to_string(),
            ..Default::default()
        }
    }

    /// What the binary does before any port binds: build the real backend, resolve it.
    async fn resolve(
        &self,
        flags: &digitalocean::RealFlags,
        wanted: &[Wanted],
    ) -> Result<digitalocean::RealBackend, String> {
        digitalocean::build_real(flags, telemetry())?
            .resolve(wanted)
            .await
    }

    /// What opening the state does for the cloud: the directory exists, then the hook runs.
    /// A rig whose account holds the snapshot and key, after a first start that looked them
    /// up and opened its state (so the profiles were saved); returns that start too.
    async fn started_and_saved() -> (Rig, digitalocean::RealBackend) {
        let rig = Rig::start().await;
        seed(&rig.emulator);
        let first = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
        rig.open_state(&first);
        (rig, first)
    }

    fn open_state(&self, real: &digitalocean::RealBackend) {
        std::fs::create_dir_all(self.state()).unwrap();
        real.cloud.state_opened(0).unwrap();
    }

    fn catalog_requests(&self) -> usize {
        catalog_requests(&self.emulator)
    }
}

fn catalog_requests(emulator: &Emulator) -> usize {
    emulator
        .requests_by_class()
        .get("catalog")
        .map_or(0, |(arrived, _)| *arrived)
}

/// Creates a machine of the offering through `real`'s cloud; the body the emulator received.
async fn create(rig: &Rig, real: &digitalocean::RealBackend, index: u32) -> Value {
    real.cloud
        .create_host(&machine(index), &ctx(Duration::from_secs(30)))
        .await
        .unwrap();
    rig.emulator.create_bodies().pop().unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn a_restart_with_the_saved_profiles_looks_nothing_up_and_creates_with_them() {
    let rig = Rig::start().await;
    let (snapshot, key) = seed(&rig.emulator);
    let first = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
    assert!(rig.catalog_requests() > 0, "a first start looks up");
    assert!(!rig.file().exists(), "saved before the state directory");
    rig.open_state(&first);
    let text = std::fs::read_to_string(rig.file()).expect("saved once the state is open");
    assert!(
        !text.contains(API_TOKEN),
        "the token is in profiles.json: {text}"
    );
    let saved = rig.saved();
    assert_eq!(saved["profiles"][0]["size"], SIZE, "{saved}");
    assert_eq!(saved["profiles"][0]["image"], json!({ "id": snapshot }));
    assert_eq!(saved["profiles"][0]["ssh_keys"], json!([{ "id": key }]));
    assert_eq!(saved["fingerprint"].as_str().map(str::len), Some(64));
    drop(first);

    let logs = LogCapture::default();
    let _guard = logs.install();
    let (requests, catalog) = (rig.emulator.requests().len(), rig.catalog_requests());
    let restarted = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
    assert_eq!(rig.catalog_requests(), catalog, "a restart looked up");
    let after = rig.emulator.requests()[requests..].to_vec();
    assert!(
        after.is_empty(),
        "API calls before serving (not even the token check may be made): {after:?}"
    );
    assert!(
        logs.text()
            .contains("settings: starting with the Droplet settings saved by the last run"),
        "{}",
        logs.text()
    );
    rig.open_state(&restarted);
    assert_eq!(std::fs::read_to_string(rig.file()).unwrap(), text);

    let body = create(&rig, &restarted, 0).await;
    assert_eq!(body["image"], json!(snapshot), "{body}");
    assert_eq!(body["ssh_keys"], json!([key]), "{body}");
    assert_eq!(rig.catalog_requests(), catalog, "a Create looked up");
}

#[tokio::test(flavor = "current_thread")]
async fn another_setting_endpoint_or_token_ignores_the_saved_profiles() {
    let (rig, _first) = Rig::started_and_saved().await;

    let logs = LogCapture::default();
    let _guard = logs.install();
    let catalog = rig.catalog_requests();
    let retagged = rig
        .resolve(&rig.flags(), &wanted(&["pool-b"]))
        .await
        .unwrap();
    assert!(
        rig.catalog_requests() > catalog,
        "another setting used the file"
    );
    assert!(
        logs.text().contains(
            "the saved Droplet settings were resolved for other settings, endpoint or token"
        ),
        "{}",
        logs.text()
    );
    rig.open_state(&retagged);
    assert_eq!(rig.saved()["profiles"][0]["tags"], json!(["pool-b"]));
    let body = create(&rig, &retagged, 0).await;
    assert!(
        body["tags"].as_array().unwrap().contains(&json!("pool-b")),
        "{body}"
    );

    // The same account behind another endpoint.
    let (other, other_url, _other_stop) = serve_emulator().await;
    seed(&other);
    let mut flags = rig.flags();
    flags.api_url = other_url;
    rig.resolve(&flags, &wanted(&["pool-b"])).await.unwrap();
    assert!(
        catalog_requests(&other) > 0,
        "another endpoint used the file"
    );

    // Another token: the look-up the file would have spared meets the emulator's refusal.
    let mut flags = rig.flags();
    flags.token = zeroize::Zeroizing::new("dop_v1_another_token_0123456789".into());
    let e = rig.resolve(&flags, &wanted(&["pool-b"])).await.unwrap_err();
    assert!(
        e.starts_with("digitalocean: the API token does not work (GET /v2/account)"),
        "{e}"
    );
    assert!(
        !logs.text().contains("dop_v1_another_token"),
        "{}",
        logs.text()
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_corrupt_file_is_ignored_with_a_warning_naming_it() {
    let (rig, _first) = Rig::started_and_saved().await;
    std::fs::write(
        rig.file(),
        b"{\"fingerprint\": \"0f\", \"profiles\": [{\"si",
    )
    .unwrap();

    let logs = LogCapture::default();
    let _guard = logs.install();
    let catalog = rig.catalog_requests();
    let restarted = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
    assert!(
        rig.catalog_requests() > catalog,
        "the corrupt file was used"
    );
    let file = rig.file().display().to_string();
    assert!(
        logs.text().lines().any(|l| l.contains("WARN")
            && l.contains(&file)
            && l.contains("the saved Droplet settings do not parse")),
        "{}",
        logs.text()
    );
    rig.open_state(&restarted);
    assert_eq!(rig.saved()["profiles"][0]["size"], SIZE, "saved again");
}

#[tokio::test(flavor = "current_thread")]
async fn a_refresh_installs_changed_profiles_and_keeps_the_last_good_on_a_problem() {
    let rig = Rig::start().await;
    let (old, _) = seed(&rig.emulator);
    let real = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
    rig.open_state(&real);
    let text = std::fs::read_to_string(rig.file()).unwrap();

    // Nothing changed: nothing to install or write.
    real.cloud.refresh_settings().await.unwrap();
    assert_eq!(std::fs::read_to_string(rig.file()).unwrap(), text);

    // A second snapshot of the name makes it ambiguous: the refresh fails, the old one stays.
    let new = rig.emulator.add_snapshot(SNAPSHOT, &[REGION]);
    let e = real.cloud.refresh_settings().await.unwrap_err();
    assert!(
        e.0.contains("2 snapshots or custom images have this name"),
        "{e:?}"
    );
    assert_eq!(create(&rig, &real, 0).await["image"], json!(old));
    assert_eq!(std::fs::read_to_string(rig.file()).unwrap(), text);

    // The old snapshot deleted, the name is the new one's: installed for Creates and saved.
    assert!(rig.emulator.delete_image(old));
    let logs = LogCapture::default();
    let _guard = logs.install();
    real.cloud.refresh_settings().await.unwrap();
    assert!(
        logs.text().contains("resolve differently now") && logs.text().contains(SIZE),
        "{}",
        logs.text()
    );
    assert_eq!(create(&rig, &real, 1).await["image"], json!(new));
    assert_eq!(rig.saved()["profiles"][0]["image"], json!({ "id": new }));

    // And the next start takes them from the file.
    let requests = rig.emulator.requests().len();
    let restarted = rig.resolve(&rig.flags(), &wanted(&[])).await.unwrap();
    assert_eq!(rig.emulator.requests().len(), requests);
    assert_eq!(create(&rig, &restarted, 2).await["image"], json!(new));
}

/// The binary: a first start saves `profiles.json` (without the token) beside its state; a
/// restart in a 429 storm serves at once from it, and from the saved prices (Creates sending
/// the saved settings are the library tests' above: here the storm's answers hold the API
/// budget back for a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_restarts_in_a_rate_limit_storm_from_the_saved_profiles() {
    let site = Site::start().await;
    let state = site.dir.path().join("state");
    let state_flag = format!("--state={}", state.display());
    let mut p = Provider::start_on(site, &[&state_flag]).await;
    let file = state.join("profiles.json");
    let text = std::fs::read_to_string(&file).expect("profiles.json once a first start serves");
    assert!(!text.contains(API_TOKEN), "the token is in profiles.json");
    let saved: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        saved["profiles"][0]["image"],
        json!({ "slug": "ubuntu-24-04-x64" }),
        "{saved}"
    );
    p.process.child.start_kill().unwrap();
    p.process.child.wait().await.unwrap();

    // Every answer from now on is a 429 asking for a minute's wait: a start that waited on
    // the API would not serve within the startup checks' minute.
    let storm = Fault {
        status: 429,
        retry_after: Some(60),
    };
    p.site.emulator.fail_next(10_000, storm);
    let restarted = std::time::Instant::now();
    p.restart(&[&state_flag]).await;
    let id = p.speculative(1).await.remove(0);
    eprintln!(
        "timing restart to serving in a 429 storm: {:?}",
        restarted.elapsed()
    );
    assert!(
        restarted.elapsed() < Duration::from_secs(30),
        "{}",
        p.logs()
    );
    assert!(
        p.logs()
            .contains("settings: starting with the Droplet settings saved by the last run"),
        "{}",
        p.logs()
    );
    assert!(!p.logs().contains(API_TOKEN));
    assert_eq!(
        p.get(&id).await.state,
        fleet_proto::v1alpha1::MachineState::Speculative as i32
    );
}

/// The binary at its price-refresh cadence: a snapshot replaced under the offering's image name
/// is picked up, saved, and sent by the next Create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_picks_a_changed_profile_up_at_the_price_refresh() {
    let site = Site::start().await;
    let (old, _) = seed(&site.emulator);
    std::fs::write(
        site.dir.path().join("offerings.json"),
        json!([{
            "size": SIZE, "region": REGION, "count": 2, "resources": {"cpu": "1", "memory": "2Gi"},
            "image": SNAPSHOT, "ssh_keys": ["ops"]
        }])
        .to_string(),
    )
    .unwrap();
    let state = site.dir.path().join("state");
    let state_flag = format!("--state={}", state.display());
    let mut p = Provider::start_on(site, &[&state_flag, "--price-refresh=1s"]).await;
    let file = state.join("profiles.json");
    let image = |file: &std::path::Path| -> Value {
        std::fs::read(file)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
            .map_or(Value::Null, |saved| saved["profiles"][0]["image"].clone())
    };
    assert_eq!(image(&file), json!({ "id": old }), "{}", p.logs());

    let new = p.site.emulator.add_snapshot(SNAPSHOT, &[REGION]);
    assert!(p.site.emulator.delete_image(old));
    let picked_up = eventually(Duration::from_secs(20), || {
        image(&file) == json!({ "id": new })
    })
    .await;
    assert!(picked_up, "{}", p.logs());
    assert!(
        p.logs()
            .contains("settings: the offerings' Droplet settings resolve differently now"),
        "{}",
        p.logs()
    );
    p.idle_machine().await;
    let body = p.site.emulator.create_bodies().pop().unwrap();
    assert_eq!(body["image"], json!(new), "{body}");
}
