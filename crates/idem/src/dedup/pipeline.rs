//! Two threads joined by a bounded queue: how both passes overlap decoding with the
//! work that follows it.

use std::ops::ControlFlow;

use crate::error::Result;

/// Runs `produce` on a second thread and `consume` on this one, joined by a queue of at
/// most `depth` items in flight. `produce` gets a `send` that returns false once the
/// consumer has stopped, which it must heed by returning; an error it sends ends the
/// pipeline with that error, and `consume` may stop it early with `Break`.
pub(crate) fn pipeline<T: Send>(
    depth: usize,
    produce: impl FnOnce(&dyn Fn(Result<T>) -> bool) + Send,
    mut consume: impl FnMut(T) -> Result<ControlFlow<()>>,
) -> Result<()> {
    std::thread::scope(|scope| {
        let (sender, receiver) = std::sync::mpsc::sync_channel::<Result<T>>(depth);
        scope.spawn(move || produce(&|item| sender.send(item).is_ok()));
        // Returning early drops the receiver, which stops the producer at its next send.
        for item in receiver {
            if consume(item?)?.is_break() {
                break;
            }
        }
        Ok(())
    })
}
