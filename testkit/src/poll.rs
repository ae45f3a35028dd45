//! Waiting for a condition instead of sleeping for a guessed time.
//!
//! A test that sleeps "long enough" either wastes time on a fast machine or fails on a
//! slow one. These helpers poll a condition until it holds and fail only when a
//! generous deadline passes, naming what was last observed. The deadline catches a
//! hang; it is not a speed requirement.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// First pause between attempts; it doubles up to [`MAX_INTERVAL`].
const FIRST_INTERVAL: Duration = Duration::from_millis(5);
const MAX_INTERVAL: Duration = Duration::from_millis(200);

/// Calls `attempt` until it returns `Ok`, and returns that value. `Err` says what was
/// observed instead; if `within` passes first, the test fails with the last one.
///
/// ```ignore
/// let lease = eventually(Duration::from_secs(30), || {
///     leases(&redis).get(&id).cloned().ok_or("no lease yet")
/// });
/// ```
#[track_caller]
pub fn eventually<T, E: Debug>(within: Duration, mut attempt: impl FnMut() -> Result<T, E>) -> T {
    let deadline = Instant::now() + within;
    let mut interval = FIRST_INTERVAL;
    loop {
        match attempt() {
            Ok(value) => return value,
            Err(observed) => {
                if Instant::now() >= deadline {
                    panic!("condition not met within {within:?}; last observed: {observed:?}");
                }
            }
        }
        std::thread::sleep(interval);
        interval = (interval * 2).min(MAX_INTERVAL);
    }
}

/// [`eventually`] for async tests: the attempt is a future, and the pauses yield to
/// the runtime instead of blocking its thread.
#[track_caller]
pub fn eventually_async<T, E: Debug, F: Future<Output = Result<T, E>>>(
    within: Duration,
    mut attempt: impl FnMut() -> F,
) -> impl Future<Output = T> {
    let caller = std::panic::Location::caller();
    async move {
        let deadline = tokio::time::Instant::now() + within;
        let mut interval = FIRST_INTERVAL;
        loop {
            match attempt().await {
                Ok(value) => return value,
                Err(observed) => {
                    if tokio::time::Instant::now() >= deadline {
                        panic!(
                            "{caller}: condition not met within {within:?}; last observed: {observed:?}"
                        );
                    }
                }
            }
            tokio::time::sleep(interval).await;
            interval = (interval * 2).min(MAX_INTERVAL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_first_success() {
        let mut calls = 0;
        let value = eventually(Duration::from_secs(5), || {
            calls += 1;
            if calls < 3 { Err(calls) } else { Ok("done") }
        });
        assert_eq!((value, calls), ("done", 3));
    }

    #[test]
    #[should_panic(expected = "last observed: \"still waiting\"")]
    fn fails_with_the_last_observation() {
        eventually(Duration::from_millis(20), || Err::<(), _>("still waiting"));
    }

    #[tokio::test]
    async fn the_async_form_polls_futures() {
        let mut calls = 0;
        let value = eventually_async(Duration::from_secs(5), || {
            calls += 1;
            let now = calls;
            async move { if now < 2 { Err(now) } else { Ok(now) } }
        })
        .await;
        assert_eq!(value, 2);
    }
}
