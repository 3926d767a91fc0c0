//! Can cuBLAS serve the CUDA linear layers? Burn's matmul (autotuned) beside cuBLAS's `gemm_ex`
//! on the LLaMA-7B step's shapes (bf16 in and out, f32 accumulation), both on buffers CubeCL
//! allocated, with cuBLAS on its own stream of the same (primary) CUDA context.
//!
//! CubeCL hands out no `CUstream`, so cuBLAS is ordered against CubeCL's work with host waits:
//! `client.sync()` before a product (its inputs are written), the cuBLAS stream synchronised
//! after it (before CubeCL reads the output). The table shows the product alone (back-to-back
//! launches, one wait at the end) and with both waits around every product, and the largest
//! difference to Burn's result relative to Burn's largest magnitude.
//!
//! `cargo bench --bench cublas_matmul -- [--iters 20]` (needs a CUDA GPU and libcublas on the
//! library path, for example PyTorch's `nvidia/cublas/lib`).

use std::ffi::c_void;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;

type Cuda = burn_cubecl::CubeBackend<CudaRuntime, bf16, i32, u8>;

/// One product `C[m, n] = op(A) B` with `A` stored `[m, k]`, or `[k, m]` when `transposed_lhs`
/// (the weight gradient `x^T dy` of a linear layer).
struct Product {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    transposed_lhs: bool,
}

const PRODUCTS: [Product; 6] = [
    Product {
        name: "q/k/v/o projection x W",
        m: 8192,
        k: 4096,
        n: 4096,
        transposed_lhs: false,
    },
    Product {
        name: "gate/up x W",
        m: 8192,
        k: 4096,
        n: 11008,
        transposed_lhs: false,
    },
    Product {
        name: "down x W",
        m: 8192,
        k: 11008,
        n: 4096,
        transposed_lhs: false,
    },
    Product {
        name: "output projection x W",
        m: 8192,
        k: 4096,
        n: 32000,
        transposed_lhs: false,
    },
    Product {
        name: "projection weight grad x^T dy",
        m: 4096,
        k: 8192,
        n: 4096,
        transposed_lhs: true,
    },
    Product {
        name: "down weight grad x^T dy",
        m: 11008,
        k: 8192,
        n: 4096,
        transposed_lhs: true,
    },
];

/// Device address of a contiguous CubeCL tensor (the resource is kept alive by the tensor).
fn address(tensor: &Tensor<Cuda, 2>) -> u64 {
    let primitive = match tensor.clone().into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => panic!("float tensors only"),
    };
    assert!(primitive.is_contiguous(), "a contiguous row-major tensor");
    let resource = primitive
        .client
        .get_resource(primitive.handle.clone())
        .expect("device address");
    resource.resource().ptr
}

/// Row-major `c = op(a) b` through cuBLAS (column-major: `c^T = b^T op(a)^T`).
///
/// # Safety
/// The three addresses hold bf16 matrices of the product's shape; nothing else writes them
/// until the stream has finished.
unsafe fn cublas_product(handle: sys::cublasHandle_t, p: &Product, a: u64, b: u64, c: u64) {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (op_a, lda) = if p.transposed_lhs {
        (sys::cublasOperation_t::CUBLAS_OP_T, p.m)
    } else {
        (sys::cublasOperation_t::CUBLAS_OP_N, p.k)
    };
    unsafe {
        blas::gemm_ex(
            handle,
            sys::cublasOperation_t::CUBLAS_OP_N,
            op_a,
            p.n as i32,
            p.m as i32,
            p.k as i32,
            (&alpha as *const f32).cast::<c_void>(),
            b as *const c_void,
            sys::cudaDataType::CUDA_R_16BF,
            p.n as i32,
            a as *const c_void,
            sys::cudaDataType::CUDA_R_16BF,
            lda as i32,
            (&beta as *const f32).cast::<c_void>(),
            c as *mut c_void,
            sys::cudaDataType::CUDA_R_16BF,
            p.n as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .expect("cublasGemmEx");
    }
}

fn seconds_per_call(iters: usize, mut call: impl FnMut(), finish: impl Fn()) -> f64 {
    call();
    finish();
    let start = Instant::now();
    for _ in 0..iters {
        call();
    }
    finish();
    start.elapsed().as_secs_f64() / iters as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .map_or(20, |v| v.parse().expect("--iters"));
    let device = CudaDevice::new(0);
    let client = CudaRuntime::client(&device);
    let context = CudaContext::new(0).expect("CUDA context");
    let stream: std::sync::Arc<CudaStream> = context.new_stream().expect("CUDA stream");
    let handle = blas::create_handle().expect("cuBLAS handle (is libcublas on the library path?)");
    // SAFETY: the handle and the stream were just created and outlive every call below.
    unsafe { blas::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
        .expect("cuBLAS stream");
    let sync_cube = || cubecl::future::block_on(client.sync()).expect("CubeCL sync");
    let sync_blas = || stream.synchronize().expect("cuBLAS stream sync");

    println!("| product | m x k x n | Burn (autotune) ms | TFLOP/s | cuBLAS ms | TFLOP/s | cuBLAS + host waits ms | max diff / max abs |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for p in &PRODUCTS {
        let lhs_dims = if p.transposed_lhs {
            [p.k, p.m]
        } else {
            [p.m, p.k]
        };
        let normal = Distribution::Normal(0.0, 1.0);
        let a = Tensor::<Cuda, 2>::random(lhs_dims, normal, &device);
        let b = Tensor::<Cuda, 2>::random([p.k, p.n], normal, &device);
        let op_a = if p.transposed_lhs {
            a.clone().transpose()
        } else {
            a.clone()
        };
        let flops = 2.0 * (p.m * p.k * p.n) as f64;

        // Burn's product; the first calls autotune.
        let burn_out = op_a.clone().matmul(b.clone());
        sync_cube();
        let burn_secs = seconds_per_call(iters, || drop(op_a.clone().matmul(b.clone())), sync_cube);

        let out = Tensor::<Cuda, 2>::zeros([p.m, p.n], &device);
        sync_cube();
        let (pa, pb, pc) = (address(&a), address(&b), address(&out));
        // SAFETY: CubeCL's queue is drained (sync above) and reads nothing below until the
        // cuBLAS stream is synchronised.
        let blas_secs = seconds_per_call(
            iters,
            || unsafe { cublas_product(handle, p, pa, pb, pc) },
            sync_blas,
        );
        let waited_secs = seconds_per_call(
            iters,
            || {
                sync_cube();
                // SAFETY: as above; the stream is synchronised right after.
                unsafe { cublas_product(handle, p, pa, pb, pc) };
                sync_blas();
            },
            || {},
        );

        let reference = burn_out
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap();
        let ours = out.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = reference
            .iter()
            .zip(&ours)
            .fold(0.0f32, |m, (r, o)| m.max((r - o).abs()));
        println!(
            "| {} | {} x {} x {} | {:.3} | {:.0} | {:.3} | {:.0} | {:.3} | {:.1e} |",
            p.name,
            p.m,
            p.k,
            p.n,
            burn_secs * 1e3,
            flops / burn_secs / 1e12,
            blas_secs * 1e3,
            flops / blas_secs / 1e12,
            waited_secs * 1e3,
            diff / scale,
        );
    }
    // SAFETY: the handle is not used after this.
    unsafe { blas::destroy_handle(handle) }.expect("destroy cuBLAS handle");
}
