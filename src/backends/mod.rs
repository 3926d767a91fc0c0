//! The capability traits of [`crate::FlashAttentionBackend`] for each supported Burn backend: the
//! one folder a Burn upgrade touches.

/// The items of [`crate::SequenceParallelBackend`] for a backend that computes and communicates
/// itself (`Inner = Self`): the distributed passes run on its own tensors and group.
macro_rules! computes_itself {
    () => {
        type Inner = Self;

        fn inner_device(device: &Self::Device) -> Self::Device {
            device.clone()
        }

        fn sequence_parallel_attention(
            q: burn::tensor::ops::FloatTensor<Self>,
            k: burn::tensor::ops::FloatTensor<Self>,
            v: burn::tensor::ops::FloatTensor<Self>,
            group: &crate::collective::DeviceGroup<Self>,
            options: &crate::sequence_parallel::SequenceParallelOptions,
        ) -> Result<
            (
                burn::tensor::ops::FloatTensor<Self>,
                burn::tensor::ops::FloatTensor<Self>,
            ),
            crate::Error,
        > {
            crate::sequence_parallel::forward_pass::<Self>(q, k, v, group, options)
        }

        fn sequence_parallel_backward(
            q: burn::tensor::ops::FloatTensor<Self>,
            k: burn::tensor::ops::FloatTensor<Self>,
            v: burn::tensor::ops::FloatTensor<Self>,
            out: burn::tensor::ops::FloatTensor<Self>,
            lse: burn::tensor::ops::FloatTensor<Self>,
            grad_out: burn::tensor::ops::FloatTensor<Self>,
            group: &crate::collective::DeviceGroup<Self>,
            options: &crate::sequence_parallel::SequenceParallelOptions,
        ) -> Result<crate::extension::Grads<Self>, crate::Error> {
            crate::sequence_parallel::backward_pass::<Self>(
                q, k, v, out, lse, grad_out, group, options,
            )
        }
    };
}

mod autodiff;
mod checkpoint_node;
pub mod cube;
mod cube_accumulators;
mod fusion;
mod fusion_group;
mod fusion_product;
mod host_offload;
mod layer_nodes;
mod linear_node;
mod ndarray;
