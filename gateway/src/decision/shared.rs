//! What the directory's answers prove where a session's record is missing: the
//! judgement behind "not found" for a client's own session ([`judge_record`]) and
//! behind "tell, open or wait" for the shared session of a 2026-07-28 principal
//! ([`judge_shared`]). Both prove an absence only where [`absence_proven`] allows.

use std::time::Duration;

use mcpgw_mesh::directory::{Recorded, Remembered};

use super::proofs::Lookup;

/// Where the shared session of a 2026-07-28 principal stands, for a worker that does not
/// hold it live. Such a client has no session id of its own, so the absence of a record
/// cannot tell it "gone": the directory remembers that the session existed, and the
/// first call after its end (on any worker) is told; only after that, or when the
/// directory proves it never existed, does a call open a fresh one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedStanding {
    /// Another worker holds it: forward there.
    Forward(String),
    /// It ended, and this call is the one to tell (the directory's memory is taken).
    TellEnded,
    /// Its owner left it for adoption and it can continue: adopt it here.
    Adopt,
    /// Proven absent (settled directory, no memory of it): open it here.
    Open,
    /// The record names this worker, which does not hold it: a claim whose answer was
    /// lost landed late. Open it here, which confirms the record.
    StaleOwnRecord,
    /// Nothing proven: the directory did not answer, or it was rebuilt less than a
    /// lease ago (it may have lost the record and the memory; the owner re-asserts
    /// them within a lease), or this worker was fenced.
    Unknown,
}

/// Judges the directory's answer for a shared session. `ours`: the generation this
/// worker registered under; `lease`: how long owners take to re-assert their records
/// after the directory was lost.
pub fn judge_shared(
    record: Lookup<Remembered>,
    this_worker: &str,
    fenced: bool,
    ours: &str,
    lease: Duration,
) -> SharedStanding {
    match record {
        Err(_) => SharedStanding::Unknown,
        Ok(_) if fenced => SharedStanding::Unknown,
        Ok(Remembered::Owner(owner)) if owner == this_worker => SharedStanding::StaleOwnRecord,
        Ok(Remembered::Owner(owner)) => SharedStanding::Forward(owner),
        Ok(Remembered::Ended) => SharedStanding::TellEnded,
        Ok(Remembered::Adoptable) => SharedStanding::Adopt,
        Ok(Remembered::Absent {
            generation,
            generation_age,
            rebuilt,
        }) => {
            if absence_proven(&generation, generation_age, rebuilt, ours, lease) {
                SharedStanding::Open
            } else {
                SharedStanding::Unknown
            }
        }
    }
}

/// The directory's owner of a client's own session, from its answer: `Ok(None)` only
/// where the absence is proven, so a directory that failed over or came back empty
/// less than a lease ago (and may have lost the record) never tells a live session
/// "not found".
pub fn judge_record(
    recorded: Lookup<Recorded>,
    ours: &str,
    lease: Duration,
) -> Lookup<Option<String>> {
    match recorded? {
        Recorded::Owner(owner) => Ok(Some(owner)),
        Recorded::Never => Ok(None),
        Recorded::Absent {
            generation,
            generation_age,
            rebuilt,
        } if absence_proven(&generation, generation_age, rebuilt, ours, lease) => Ok(None),
        Recorded::Absent { .. } => Err(
            "the directory was rebuilt or failed over less than a lease ago: a missing \
             record proves nothing yet"
                .into(),
        ),
    }
}

/// Whether a record the directory does not hold is really absent: only in the
/// generation this worker registered under (`ours`), and only once that generation is
/// older than a lease if a worker rebuilt it (after Redis came back empty or failed
/// over, owners take up to a lease to write their records again). A young directory
/// that no worker rebuilt is a new fleet's: nothing was lost.
pub fn absence_proven(
    generation: &str,
    generation_age: Duration,
    rebuilt: bool,
    ours: &str,
    lease: Duration,
) -> bool {
    let settled = generation_age > lease || !rebuilt;
    !generation.is_empty() && generation == ours && settled
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_session_opens_only_where_its_absence_is_proven() {
        let lease = Duration::from_secs(10);
        let settled = || Remembered::Absent {
            generation: "g1".into(),
            generation_age: Duration::from_secs(11),
            rebuilt: true,
        };
        let judge = |record, fenced| judge_shared(record, "me", fenced, "g1", lease);
        assert_eq!(
            judge(Ok(Remembered::Owner("peer".into())), false),
            SharedStanding::Forward("peer".into())
        );
        assert_eq!(
            judge(Ok(Remembered::Owner("me".into())), false),
            SharedStanding::StaleOwnRecord
        );
        assert_eq!(
            judge(Ok(Remembered::Ended), false),
            SharedStanding::TellEnded
        );
        assert_eq!(judge(Ok(settled()), false), SharedStanding::Open);
        // A directory rebuilt less than a lease ago, one of another generation (rebuilt
        // since this worker registered), or none yet: the record and its memory may be
        // lost, so absence is unknown, never proven.
        for (generation, age) in [("g1", 10), ("g1", 3), ("g2", 60), ("", 60)] {
            let young = Remembered::Absent {
                generation: generation.into(),
                generation_age: Duration::from_secs(age),
                rebuilt: true,
            };
            assert_eq!(
                judge(Ok(young), false),
                SharedStanding::Unknown,
                "{generation} {age}s"
            );
        }
        // A young directory nobody rebuilt is a new fleet's: absence is proven at once.
        let new_fleet = Remembered::Absent {
            generation: "g1".into(),
            generation_age: Duration::from_secs(1),
            rebuilt: false,
        };
        assert_eq!(judge(Ok(new_fleet), false), SharedStanding::Open);
        assert_eq!(
            judge(Err("timed out".into()), false),
            SharedStanding::Unknown
        );
        assert_eq!(judge(Ok(settled()), true), SharedStanding::Unknown);
        assert_eq!(judge(Ok(Remembered::Ended), true), SharedStanding::Unknown);
        assert_eq!(
            judge(Ok(Remembered::Adoptable), false),
            SharedStanding::Adopt
        );
        assert_eq!(
            judge(Ok(Remembered::Adoptable), true),
            SharedStanding::Unknown,
            "a fenced worker adopts nothing"
        );
    }

    #[test]
    fn a_missing_record_is_absent_only_in_a_settled_directory() {
        let lease = Duration::from_secs(10);
        let absent = |generation: &str, age, rebuilt| {
            Ok(Recorded::Absent {
                generation: generation.into(),
                generation_age: Duration::from_secs(age),
                rebuilt,
            })
        };
        let judge = |recorded| judge_record(recorded, "g1", lease);
        assert_eq!(
            judge(Ok(Recorded::Owner("w1".into()))),
            Ok(Some("w1".into()))
        );
        assert_eq!(judge(Ok(Recorded::Never)), Ok(None));
        assert_eq!(judge(absent("g1", 11, true)), Ok(None));
        assert_eq!(judge(absent("g1", 1, false)), Ok(None), "a new fleet's");
        for (generation, age) in [("g1", 3), ("g2", 60), ("", 60)] {
            assert!(
                judge(absent(generation, age, true)).is_err(),
                "{generation} {age}s proves nothing"
            );
        }
        assert!(judge(Err("timeout".into())).is_err());
    }
}
