//! Subcommands every provider binary offers besides serving: `state export`, `state import`
//! and `admin failed list|release`.

use std::path::PathBuf;

use clap::Subcommand;

use crate::admin::{self, AdminRequest};

/// Subcommands that do not start a server.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Inspect the durable state without starting a server.
    State {
        #[command(subcommand)]
        action: StateAction,
    },
    /// Talk to a running provider over its admin socket.
    Admin {
        #[command(subcommand)]
        action: AdminAction,
    },
}

#[derive(Subcommand, Debug, Clone)]
pub enum StateAction {
    /// Print the whole state as JSON.
    Export {
        /// The provider's --state: a state directory, a reference state file or an etcd:// address.
        #[arg(long, value_name = "STATE")]
        state: String,
        #[command(flatten)]
        etcd: crate::etcd::EtcdArgs,
    },
    /// Copy a state between a local state directory and etcd (either way), checked after copying.
    Import {
        /// The state to copy: a state directory or an etcd:// address.
        #[arg(long, value_name = "STATE")]
        from: String,
        /// Where to copy it: a new or empty directory, or an etcd:// prefix with no state.
        #[arg(long, value_name = "STATE")]
        to: String,
        #[command(flatten)]
        etcd: crate::etcd::EtcdArgs,
    },
}

#[derive(Subcommand, Debug, Clone)]
pub enum AdminAction {
    /// FAILED machines.
    Failed {
        #[command(subcommand)]
        action: FailedAction,
    },
}

#[derive(Subcommand, Debug, Clone)]
pub enum FailedAction {
    /// List FAILED machines with their host and last error.
    List {
        /// The provider's --admin-socket path.
        #[arg(long = "admin-socket", value_name = "PATH")]
        admin_socket: PathBuf,
    },
    /// Delete the FAILED machine's host (if any) and return the slot to SPECULATIVE.
    Release {
        /// The machine id.
        id: String,
        /// The provider's --admin-socket path.
        #[arg(long = "admin-socket", value_name = "PATH")]
        admin_socket: PathBuf,
    },
}

/// Runs a subcommand and returns what to print on stdout.
pub async fn run(command: Command) -> Result<String, String> {
    match command {
        Command::State {
            action: StateAction::Export { state, etcd },
        } if crate::etcd::is_etcd(&state) => crate::etcd::export_json(&state, &etcd).await,
        Command::State {
            action: StateAction::Export { state, .. },
        } => crate::durable::export_json(std::path::Path::new(&state)),
        Command::State {
            action: StateAction::Import { from, to, etcd },
        } => crate::etcd::import(&from, &to, &etcd).await,
        Command::Admin {
            action: AdminAction::Failed { action },
        } => match action {
            FailedAction::List { admin_socket } => {
                let reply = admin::call(&admin_socket, &AdminRequest::FailedList).await?;
                if !reply.ok {
                    return Err(reply.error);
                }
                serde_json::to_string_pretty(&reply.failed).map_err(|e| e.to_string())
            }
            FailedAction::Release { id, admin_socket } => {
                let reply = admin::call(
                    &admin_socket,
                    &AdminRequest::Release {
                        machine_id: id.clone(),
                    },
                )
                .await?;
                if reply.ok {
                    Ok(if reply.message.is_empty() {
                        format!("released {id}")
                    } else {
                        reply.message
                    })
                } else {
                    Err(reply.error)
                }
            }
        },
    }
}
