//! Agent enrollment (docs/digitalocean/security.md): the token in a Droplet's user_data is a
//! one-time credential. The agent's first request presents it with a credential of its own
//! (32 random bytes); the provider records, durably and in the machine's own slot, which
//! Droplet enrolled and a digest of that credential, and from then on only the credential
//! speaks for the machine. Once the enrolled agent acknowledged a Configure's blob, the
//! enrollment is confirmed, and a later enrollment with the spent token (anything on the node
//! can read it) is a replay: refused, counted, and nothing changes for the enrolled agent.
//! Before that, a second enrollment cannot be told from the real agent's: it is a conflict,
//! and nothing is delivered to the machine any more.
//!
//! Why a random secret and not an ed25519 key: the channel is already a pinned TLS 1.3 channel
//! with bearer authentication, so a bearer secret changes nothing in its shape, needs no
//! challenge round trip or replay protection, and the state keeps only a digest of it, which
//! is as useless to a reader of the state as a public key would be.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use provider_core::engine::EnrollmentRecord;
use provider_core::inventory::{EnrollVerdict, enrollment_holds};
use provider_core::records::Enrollment;
use provider_core::replica::Leading;
use zeroize::Zeroizing;

/// `--bootstrap-enrollment-source`: where an enrollment may come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EnrollmentSource {
    /// Only from an address the cloud assigned to the Droplet (public IPv4/IPv6, VPC).
    #[default]
    Droplet,
    /// From anywhere: the channel is reached through a NAT or a proxy.
    Any,
}

impl EnrollmentSource {
    pub fn name(self) -> &'static str {
        match self {
            EnrollmentSource::Droplet => "droplet",
            EnrollmentSource::Any => "any",
        }
    }
}

/// A Droplet of one machine, as the cloud reports it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropletSighting {
    pub id: String,
    /// It carries [`crate::naming::ENROLLMENT_TOKEN_TAG`]: its user_data holds a one-time
    /// enrollment token, so no per-slot token speaks for it.
    pub enrollment_token: bool,
    /// Every address the cloud assigned to it: public IPv4 and IPv6, VPC.
    pub addresses: Vec<IpAddr>,
}

/// Where the channel looks up the Droplets of a machine (the cloud's API).
#[async_trait]
pub trait DropletDirectory: Send + Sync + 'static {
    /// The Droplets this provider owns for `machine_id`.
    async fn droplets_of(&self, machine_id: &str) -> Result<Vec<DropletSighting>, String>;
}

/// What the state records of a machine for its agent.
#[derive(Clone, Debug, Default)]
pub(crate) struct MachineView {
    /// The operation id of the machine's Create (`None` where no state is attached).
    pub create_operation: Option<String>,
    /// The recorded host (Droplet id), if any.
    pub host_id: Option<String>,
    /// The enrollment that speaks for the recorded host now.
    pub enrollment: Option<Arc<Enrollment>>,
}

impl MachineView {
    fn of(record: EnrollmentRecord) -> MachineView {
        let enrollment = record
            .enrollment
            .filter(|e| enrollment_holds(&record.machine, e));
        MachineView {
            create_operation: record.create_operation,
            host_id: record.machine.host.as_ref().map(|h| h.id.clone()),
            enrollment,
        }
    }
}

/// Why the book could not answer.
#[derive(Debug)]
pub(crate) enum BookError {
    /// This replica does not serve (a standby, or a leader whose claim lapsed).
    NotServing,
    /// The machine does not exist.
    Unknown,
    /// The state refused or failed the write.
    Refused(String),
}

/// Where enrollments are kept: the provider's state (through the engine of the term this
/// replica leads), or, for a channel with no provider around it (tests, fuzzing), memory.
pub(crate) enum Book {
    State(Leading),
    Memory(Mutex<HashMap<String, Arc<Enrollment>>>),
}

impl Book {
    pub fn view(&self, machine_id: &str) -> Result<MachineView, BookError> {
        match self {
            Book::State(leading) => {
                let engine = leading.engine().ok_or(BookError::NotServing)?;
                engine
                    .enrollment_record(machine_id)
                    .map(MachineView::of)
                    .ok_or(BookError::Unknown)
            }
            Book::Memory(map) => Ok(MachineView {
                enrollment: lock(map).get(machine_id).cloned(),
                ..MachineView::default()
            }),
        }
    }

    /// Records `enrollment` (durably, for the state) and says what it came to.
    pub async fn record(
        &self,
        machine_id: &str,
        enrollment: Enrollment,
    ) -> Result<EnrollVerdict, BookError> {
        match self {
            Book::State(leading) => {
                let engine = leading.engine().ok_or(BookError::NotServing)?;
                engine
                    .record_enrollment(machine_id, enrollment)
                    .await
                    .map_err(|e| BookError::Refused(e.to_string()))
            }
            Book::Memory(map) => {
                let mut map = lock(map);
                let verdict = match map.get(machine_id) {
                    Some(held) if held.conflict => EnrollVerdict::Conflict,
                    Some(held) if held.credential_digest == enrollment.credential_digest => {
                        if enrollment.confirmed && !held.confirmed {
                            let confirmed = Arc::new(Enrollment {
                                confirmed: true,
                                ..Enrollment::clone(held)
                            });
                            map.insert(machine_id.to_owned(), confirmed);
                        }
                        EnrollVerdict::AlreadyEnrolled
                    }
                    Some(held) if held.confirmed => EnrollVerdict::Replayed,
                    Some(held) => {
                        let marked = Arc::new(Enrollment {
                            conflict: true,
                            ..Enrollment::clone(held)
                        });
                        map.insert(machine_id.to_owned(), marked);
                        EnrollVerdict::Conflict
                    }
                    None => {
                        map.insert(machine_id.to_owned(), Arc::new(enrollment));
                        EnrollVerdict::Enrolled
                    }
                };
                Ok(verdict)
            }
        }
    }
}

impl Book {
    /// Confirms the enrollment that speaks for `machine_id`'s host (its agent acknowledged a
    /// Configure's blob), durably for the state; nothing to do when there is none or it is
    /// confirmed already.
    pub async fn confirm(&self, machine_id: &str) -> Result<(), BookError> {
        let Some(held) = self.view(machine_id)?.enrollment else {
            return Ok(());
        };
        if held.confirmed || held.conflict {
            return Ok(());
        }
        let confirmed = Enrollment {
            confirmed: true,
            ..Enrollment::clone(&held)
        };
        self.record(machine_id, confirmed).await.map(|_| ())
    }

    /// Takes the in-memory enrollments of `other`, as a new process takes them from the
    /// state it loads (for channels with no provider state around them).
    pub fn adopt(&self, other: &Book) {
        if let (Book::Memory(mine), Book::Memory(theirs)) = (self, other) {
            let copied = lock(theirs).clone();
            lock(mine).extend(copied);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An enrollment request's body: `{"credential": "<43 characters of base64url>"}`, the
/// credential 32 bytes. Keys match case-insensitively and unknown keys are ignored, as for
/// acks; anything else (a credential of another length or alphabet, a wrong type) is refused.
#[derive(Debug)]
pub struct EnrollRequest {
    /// Zeroed on drop, never printed.
    pub credential: Zeroizing<String>,
}

/// The credential's length: 32 bytes in unpadded base64url.
pub const CREDENTIAL_LEN: usize = 43;

/// Decodes an enrollment body (see [`EnrollRequest`]).
pub fn parse_enroll(body: &[u8]) -> Option<EnrollRequest> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let serde_json::Value::Object(object) = value else {
        return None;
    };
    let mut credential = None;
    for (key, value) in object {
        if key.eq_ignore_ascii_case("credential") {
            let serde_json::Value::String(s) = value else {
                return None;
            };
            credential = Some(Zeroizing::new(s));
        }
    }
    let credential = credential?;
    let decoded = Zeroizing::new(URL_SAFE_NO_PAD.decode(credential.as_bytes()).ok()?);
    (credential.len() == CREDENTIAL_LEN && decoded.len() == 32)
        .then_some(EnrollRequest { credential })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enroll_bodies_decode_strictly() {
        let good = crate::token::new_credential();
        let body = format!("{{\"credential\":\"{}\"}}", good.expose());
        assert_eq!(
            parse_enroll(body.as_bytes()).map(|r| r.credential.to_string()),
            Some(good.expose().to_owned())
        );
        let upper = format!("{{\"CREDENTIAL\":\"{}\",\"x\":1}}", good.expose());
        assert!(parse_enroll(upper.as_bytes()).is_some());
        for bad in [
            "",
            "null",
            "[]",
            "{}",
            "{\"credential\":1}",
            "{\"credential\":\"short\"}",
            "{\"credential\":\"!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\"}",
        ] {
            assert!(parse_enroll(bad.as_bytes()).is_none(), "{bad}");
        }
    }

    #[tokio::test]
    async fn the_memory_book_decides_as_the_state_does() {
        let book = Book::Memory(Mutex::default());
        let e = |digest: u8| Enrollment {
            host_id: "1".into(),
            create_operation: "op-1".into(),
            credential_digest: vec![digest],
            conflict: false,
            confirmed: false,
        };
        // Confirmed, another credential is a replay and changes nothing.
        assert_eq!(
            book.record("c", e(1)).await.ok(),
            Some(EnrollVerdict::Enrolled)
        );
        book.confirm("c").await.unwrap();
        assert!(book.view("c").unwrap().enrollment.unwrap().confirmed);
        assert_eq!(
            book.record("c", e(2)).await.ok(),
            Some(EnrollVerdict::Replayed)
        );
        let held = book.view("c").unwrap().enrollment.unwrap();
        assert!(held.confirmed && !held.conflict && held.credential_digest == vec![1]);
        assert_eq!(
            book.record("c", e(1)).await.ok(),
            Some(EnrollVerdict::AlreadyEnrolled)
        );
        // Unconfirmed, it is a conflict.
        assert_eq!(
            book.record("m", e(1)).await.ok(),
            Some(EnrollVerdict::Enrolled)
        );
        assert_eq!(
            book.record("m", e(1)).await.ok(),
            Some(EnrollVerdict::AlreadyEnrolled)
        );
        assert_eq!(
            book.record("m", e(2)).await.ok(),
            Some(EnrollVerdict::Conflict)
        );
        // Once in conflict, even the first credential is refused.
        assert_eq!(
            book.record("m", e(1)).await.ok(),
            Some(EnrollVerdict::Conflict)
        );
        assert!(book.view("m").unwrap().enrollment.unwrap().conflict);
    }
}
