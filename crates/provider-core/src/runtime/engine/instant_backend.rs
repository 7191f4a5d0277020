//! A backend for engine tests: seeds Speculative machines `m-00000`, `m-00001`, … and finishes
//! every transition at once.

use async_trait::async_trait;

use super::*;
use crate::rules::machine::{CapacityType, HostRef};

/// Seeds `n` Speculative machines; every transition finishes at once.
pub(super) struct InstantBackend(pub(super) usize);

#[async_trait]
impl Backend for InstantBackend {
    async fn describe(&self) -> Result<Vec<Machine>, BackendError> {
        Ok((0..self.0)
            .map(|i| {
                let mut m = Machine::speculative(format!("m-{i:05}"), "cx22");
                m.zone = "z".into();
                m.capacity_type = CapacityType::OnDemand;
                m
            })
            .collect())
    }
    async fn create(
        &self,
        machine: &Machine,
        _: &TransitionContext,
    ) -> Result<Effect, BackendError> {
        Ok(Effect {
            host: Some(HostRef {
                provider: "p".into(),
                id: format!("h-{}", machine.id),
            }),
            ..Effect::default()
        })
    }
    async fn configure(
        &self,
        _: &Machine,
        _: &ConfigureOrder,
        _: &TransitionContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }
    async fn drain(&self, _: &Machine, _: i64, _: &TransitionContext) -> Result<(), BackendError> {
        Ok(())
    }
    async fn delete(&self, _: &Machine, _: &TransitionContext) -> Result<(), BackendError> {
        Ok(())
    }
}
