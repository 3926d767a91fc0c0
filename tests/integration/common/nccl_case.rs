//! Sequence-parallel cases on NCCL groups of real GPUs (the `nccl` feature's ignored tests).

use burn::backend::Autodiff;
use burn_cubecl::{CubeBackend, FloatElement};
use burn_distflash::collective::nccl;
use burn_distflash::DeviceGroup;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use distflash_kernels::ElemType;

use super::distributed_case::{check_groups, Case};

/// The CUDA backend with float type `F`, as the NCCL groups hold it.
pub type Cuda<F> = CubeBackend<CudaRuntime, F, i32, u8>;

/// For each world size of `worlds` this machine has GPUs for (the others are skipped with a
/// message; a machine without GPUs for the smallest fails the test), checks every case of `cases(world)` on a fresh NCCL group of that many GPUs under
/// `Autodiff`, in float type `elem` (that of `F`), against the single-device reference.
pub fn check_nccl_worlds<F: FloatElement>(
    worlds: &[usize],
    elem: ElemType,
    cases: impl Fn(usize) -> Vec<Case>,
) {
    let available = nccl::device_count().expect("CUDA driver");
    let smallest = worlds.iter().copied().min().unwrap_or(0);
    assert!(
        available >= smallest,
        "needs at least {smallest} CUDA GPUs for the smallest world size, this machine has \
         {available}"
    );
    for &world in worlds {
        if available < world {
            eprintln!("skipping world size {world}: {available} GPUs");
            continue;
        }
        for case in cases(world) {
            let devices: Vec<CudaDevice> = (0..world).map(CudaDevice::new).collect();
            let groups = DeviceGroup::<Cuda<F>>::nccl(&devices).expect("NCCL group");
            check_groups::<Autodiff<Cuda<F>>>(devices, groups, case, elem);
            eprintln!("ok: {case:?}");
        }
    }
}
