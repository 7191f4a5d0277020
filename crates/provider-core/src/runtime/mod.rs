//! The running state: the async engine over the rules, a store and a backend; which replica
//! may drive it (single, or elected through the etcd store behind `--state etcd://`); the
//! periodic reconcile.

pub mod engine;
pub mod etcd;
pub mod reconcile_loop;
pub mod replica;
