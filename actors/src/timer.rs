//! The one timer a request machine needs: armed at the machine's `poll_timeout`, re-armed only
//! when that instant changes, cancelled when the machine is done. Used by the scheduler and the
//! router alike.

use std::time::Duration;

use actix::{Actor, AsyncContext, Context, SpawnHandle};

/// A request's armed timer: when it fires (milliseconds on the owner's clock) and its handle.
pub type MachineTimer = Option<(u64, SpawnHandle)>;

/// Makes `timer` fire at `next` (or never, for `None`), `now_ms` being the owner's clock now;
/// `fire` runs when it does. Nothing changes if the timer is already set for `next`.
pub fn rearm<A>(
    timer: &mut MachineTimer,
    next: Option<u64>,
    now_ms: u64,
    ctx: &mut Context<A>,
    fire: impl FnOnce(&mut A, &mut Context<A>) + 'static,
) where
    A: Actor<Context = Context<A>>,
{
    if timer.as_ref().map(|(at, _)| *at) == next {
        return;
    }
    cancel(timer, ctx);
    if let Some(at) = next {
        let delay = Duration::from_millis(at.saturating_sub(now_ms));
        *timer = Some((at, ctx.run_later(delay, fire)));
    }
}

/// Cancels `timer` if it is armed.
pub fn cancel<A>(timer: &mut MachineTimer, ctx: &mut Context<A>)
where
    A: Actor<Context = Context<A>>,
{
    if let Some((_, handle)) = timer.take() {
        ctx.cancel_future(handle);
    }
}
