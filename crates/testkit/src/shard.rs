//! BigFleet's shard (the `shard-model` crate's two models, full and incremental reconcile) fed
//! the answers of an engine: every List, ack and Get a test reads goes through both, and
//! [`EngineShards::verdict`] fails a test whose provider gave an answer the shard cannot apply.

use std::sync::Arc;

use provider_core::error::CoreError;
use provider_core::{Ack, Engine, FenceToken, ListQuery, MachineState};
use shard_model::{Shards, State};

/// A state as the models keep it.
pub fn state(s: MachineState) -> State {
    State::from_wire(s.wire())
}

/// Both shard models over one engine.
#[derive(Debug, Default)]
pub struct EngineShards {
    pub models: Shards,
}

impl EngineShards {
    pub fn new() -> EngineShards {
        EngineShards::default()
    }

    /// Both reconcile: the full one a full List, the incremental one a List since its cursor.
    pub fn reconcile(&mut self, engine: &Engine) {
        for model in [&mut self.models.full, &mut self.models.incremental] {
            let listing = engine.list(&ListQuery {
                since_revision: model.since(),
                ..ListQuery::default()
            });
            let machines: Vec<(String, State)> = listing
                .machines
                .iter()
                .map(|m| (m.id.clone(), state(m.state)))
                .collect();
            model.read_list(&machines, listing.revision.to_string().into_bytes());
        }
    }

    /// Both take a mutation's answer: an ack is applied, a Create's error marks the machine
    /// Failed.
    pub fn answer(&mut self, create: bool, id: &str, answer: &Result<Ack, CoreError>) {
        match answer {
            Ok(ack) => self.models.apply(id, state(ack.machine.state), "ack"),
            Err(_) if create => self.models.create_refused(id),
            Err(_) => {}
        }
    }

    /// Both read a Get.
    pub fn get(&mut self, engine: &Engine, id: &str) {
        if let Ok(m) = engine.get(id) {
            self.models.apply(id, state(m.state), "Get");
        }
    }

    /// A Create as a shard sends it, its answer read by both.
    pub async fn create(&mut self, engine: &Arc<Engine>, id: &str) -> Result<Ack, CoreError> {
        let zero = FenceToken {
            shard_id: String::new(),
            epoch: 0,
            sequence: 0,
        };
        let answer = engine.create(id, zero).await;
        self.answer(true, id, &answer);
        answer
    }

    /// One line of a timeline, printed by the scenarios: for each of `ids`, what the provider
    /// reports (its Get) and what each shard holds, after `step`.
    pub fn timeline(&self, engine: &Engine, step: &str, ids: &[&str]) -> String {
        let held = |model: &shard_model::ShardModel, id: &str| {
            model
                .held
                .get(id)
                .map_or("-".to_owned(), |s| format!("{s:?}"))
        };
        let cells: Vec<String> = ids
            .iter()
            .map(|id| {
                let reported = engine
                    .get(id)
                    .map_or("gone".to_owned(), |m| m.state.to_string());
                let short = id.rsplit('/').next().unwrap_or(id);
                format!(
                    "…/{short}: provider {reported}, full {}, incremental {}",
                    held(&self.models.full, id),
                    held(&self.models.incremental, id)
                )
            })
            .collect();
        let line = format!("timeline | {step} | {}", cells.join("; "));
        eprintln!("{line}");
        line
    }

    /// A last reconcile, then both verdicts against the engine's Get.
    pub fn verdict(&mut self, engine: &Engine) -> Result<(), String> {
        self.reconcile(engine);
        self.models
            .verdict_with(|id| engine.get(id).ok().map(|m| state(m.state)))
    }
}
