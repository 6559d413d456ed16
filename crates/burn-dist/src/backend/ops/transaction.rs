//! Forwards `TransactionOps` to the inner backend.
//!
//! Its one method takes `TransactionPrimitive<Self>`, a struct generic over the backend whose
//! private `orders` field cannot be moved across, and returns `impl Future`, so it is written by
//! hand: the inner backend only reads the four public `read_*` lists (`orders` is `pub(crate)` in
//! burn-backend, so no backend outside it can read it), and the caller
//! (`TransactionPrimitive::execute_async`) keeps its own `orders`.

#[allow(unused_imports)]
use super::prelude::*;

forward! {
    ops TransactionOps;
    const FORWARDED;
    by_hand [tr_execute] {
        fn tr_execute(
            transaction: TransactionPrimitive<Self>,
        ) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
            let TransactionPrimitive {
                read_floats,
                read_qfloats,
                read_ints,
                read_bools,
                ..
            } = transaction;
            // Reading values is not an op: stage-3 handles are counted as reads.
            let read_floats = read_floats.into_iter().map(P::read).collect();
            B::tr_execute(TransactionPrimitive::<B>::new(
                read_floats,
                read_qfloats,
                read_ints,
                read_bools,
            ))
        }
    }
    // @generated begin
    // @generated end
}
