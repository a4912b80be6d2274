//! The skeleton of a candle custom op, written once: [`custom_op!`] makes an op's
//! `CustomOp1`/`2`/`3` impl from its name and its bodies, for the kernels (`crate::kernels`)
//! and for the ops that hand candle a value computed apart (the collectives' autograd ops).

/// One custom op's impl of candle's `CustomOp1`/`2`/`3`, written once for every op: its
/// name, the body of its CPU forward and the body of its CUDA forward over the inputs the
/// caller names (`(sx: lx, sw: lw)`: each input's storage and layout, the same names on both
/// devices), then any further items of the trait written as they are (`fn bwd`). The bodies,
/// and the name, see the op as the CPU body's `|this|` (`self` does not cross a macro); the
/// CUDA body is compiled with the `cuda` feature only.
macro_rules! custom_op {
    (
        $trait:ident for $op:ty, $name:expr, ($($s:ident: $l:ident),+),
        cpu |$cpu_op:tt| $cpu:expr,
        cuda |$cuda_op:tt| $cuda:expr
        $(, $item:item)* $(,)?
    ) => {
        $crate::runtime::custom_op::custom_op! {
            $trait for $op, $name, ($($s: $l),+),
            cpu |$cpu_op| $cpu,
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $($s: &candle_core::CudaStorage, $l: &candle_core::Layout),+
            ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
                let $cuda_op = self;
                $cuda
            }
            $(, $item)*
        }
    };
    // The impl; an op with no CUDA kernel of its own comes here directly (candle's default
    // says so on a GPU), one with a kernel with its `cuda_fwd` made above as the first item.
    (
        $trait:ident for $op:ty, $name:expr, ($($s:ident: $l:ident),+),
        cpu |$cpu_op:tt| $cpu:expr
        $(, $item:item)* $(,)?
    ) => {
        impl candle_core::$trait for $op {
            $crate::runtime::custom_op::custom_op!(@cpu $name, ($($s: $l),+), |$cpu_op| $cpu);

            $($item)*
        }
    };
    (@cpu $name:expr, ($($s:ident: $l:ident),+), |$cpu_op:tt| $cpu:expr) => {
        #[allow(unused_variables)]
        fn name(&self) -> &'static str {
            let $cpu_op = self;
            $name
        }

        fn cpu_fwd(
            &self,
            $($s: &candle_core::CpuStorage, $l: &candle_core::Layout),+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            let $cpu_op = self;
            $cpu
        }
    };
}
pub(crate) use custom_op;
