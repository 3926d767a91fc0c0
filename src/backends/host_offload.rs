//! [`HostOffload`] per backend: the synchronous defaults on ndarray, `Fusion` and `Autodiff`
//! (whose `prepare` serves the backend under it, where its checkpoints live); on `CubeBackend`,
//! CUDA tensors go through pinned memory on a copy stream (feature `pinned-offload`), other
//! runtimes' (wgpu) take the defaults.

use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::Autodiff;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_fusion::{Fusion, FusionBackend};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use crate::offload::HostOffload;
#[cfg(feature = "pinned-offload")]
use crate::offload::{check_host_memory, pinned, HostTensor};
#[cfg(feature = "pinned-offload")]
use crate::Error;

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> HostOffload for NdArray<E, I, Q> where
    NdArrayTensor: From<SharedArray<E>> + From<SharedArray<I>>
{
}

impl<B: FusionBackend> HostOffload for Fusion<B> {}

impl<B: HostOffload, C: CheckpointStrategy> HostOffload for Autodiff<B, C> {
    fn prepare_host_offload(device: &B::Device, sizes: &[usize]) -> Result<(), crate::Error> {
        B::prepare_host_offload(device, sizes)
    }
}

impl<R, F, I, BT> HostOffload for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    #[cfg(feature = "pinned-offload")]
    fn offload_to_host(
        tensor: burn_cubecl::tensor::CubeTensor<R>,
    ) -> Result<HostTensor<Self>, Error> {
        match pinned::as_cuda(tensor) {
            Ok(cuda) => pinned::offload(cuda).map(HostTensor::pinned),
            Err(tensor) => HostTensor::read(tensor),
        }
    }

    #[cfg(feature = "pinned-offload")]
    fn prepare_host_offload(device: &R::Device, sizes: &[usize]) -> Result<(), Error> {
        match pinned::as_cuda_device(device) {
            Some(cuda) => pinned::reserve(cuda, sizes),
            None => check_host_memory(sizes),
        }
    }
}
