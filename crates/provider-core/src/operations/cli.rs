//! Subcommands every provider binary offers besides serving: `check`, `state export`,
//! `state import` and `admin failed list|release`.

use std::path::PathBuf;

use clap::Subcommand;

use crate::operations::admin::{self, AdminRequest};

/// Subcommands that do not start a server.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Check a configuration without serving (read-only cloud API calls).
    ///
    /// Takes exactly the serving flags and prints one line per check with OK or the problem:
    /// TLS material, the token, each offering's type and zone (deprecated or not sold there
    /// now), image, networks and the like, and the account's limits where the cloud has them.
    /// Exit status 0 only when every check passed.
    #[command(after_help = "The serving flags are those of the binary itself (see its --help).")]
    Check {
        /// Print one JSON document (`ok`, `problems`, `checks[]`) instead of lines.
        #[arg(long)]
        json: bool,
        /// The serving flags, exactly as the provider is started with them.
        #[arg(
            value_name = "SERVING FLAGS",
            trailing_var_arg = true,
            allow_hyphen_values = true
        )]
        flags: Vec<String>,
    },
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
        etcd: crate::runtime::etcd::EtcdArgs,
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
        etcd: crate::runtime::etcd::EtcdArgs,
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
        // `check` as the first argument is run by the binary before this parse
        // ([`crate::operations::check::split_args`]); only its `--help` is clap's.
        Command::Check { .. } => Err(format!(
            "`{}` must be the first argument: <binary> check [--json] [SERVING FLAGS]...",
            crate::operations::check::SUBCOMMAND
        )),
        Command::State {
            action: StateAction::Export { state, etcd },
        } if crate::runtime::etcd::is_etcd(&state) => {
            crate::runtime::etcd::export_json(&state, &etcd).await
        }
        Command::State {
            action: StateAction::Export { state, .. },
        } => crate::persistence::durable::export_json(std::path::Path::new(&state)),
        Command::State {
            action: StateAction::Import { from, to, etcd },
        } => crate::runtime::etcd::import(&from, &to, &etcd).await,
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
