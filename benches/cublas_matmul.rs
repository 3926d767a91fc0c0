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
//! With `--hopper`, the table is instead the Hopper matrix product of the kernels crate
//! (`distflash_kernels::hopper::gemm`: `wgmma`, TMA, warp specialisation, launched through
//! CubeCL) beside cuBLAS in the same layout, on 4096^3, 8192^3 and the LLaMA-7B projection and
//! gate/up shapes, for both layouts of B (`[N, K]`: C = A B^T; `[K, N]`: C = A B); each row also
//! gives the first call's seconds (NVRTC compile and module load included) and the largest
//! difference to cuBLAS's result relative to cuBLAS's largest magnitude.
//!
//! `cargo bench --bench cublas_matmul -- [--iters 20] [--hopper]` (`-- --help` lists them;
//! needs a CUDA GPU, an H100 or H200 for `--hopper`, and libcublas on the library path, for
//! example PyTorch's `nvidia/cublas/lib`).

mod common;

use std::ffi::c_void;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor, TensorMetadata, TensorPrimitive};
use clap::{value_parser, Parser};
use common::CargoBench;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{CudaContext, CudaStream};
use distflash_kernels::hopper::{self, GemmLayout};
use distflash_kernels::{DeviceTensor, ElemType};
use half::bf16;

type Cuda = burn_cubecl::CubeBackend<CudaRuntime, bf16, i32, u8>;

/// The bench's command line.
#[derive(Parser)]
#[command(about = "cuBLAS beside Burn's matmul (or, with --hopper, the Hopper matrix product)")]
struct Args {
    /// Calls timed per product
    #[arg(long, value_name = "N", value_parser = value_parser!(u64).range(1..), default_value_t = 20)]
    iters: u64,
    /// The Hopper matrix product beside cuBLAS instead (an H100 or H200)
    #[arg(long)]
    hopper: bool,
    #[command(flatten)]
    cargo_bench: CargoBench,
}

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

/// One row-major bf16 product `c[m, n] = op(a) op(b)` for cuBLAS: `a` stored `[k, m]` when
/// `a_transposed` (else `[m, k]`), `b` stored `[n, k]` when `b_transposed` (else `[k, n]`).
#[derive(Clone, Copy)]
struct RowMajorGemm {
    m: usize,
    n: usize,
    k: usize,
    a_transposed: bool,
    b_transposed: bool,
}

impl RowMajorGemm {
    /// Queues the product (column-major: `c^T = op(b)^T op(a)^T`, so B's buffer comes first and
    /// a row-major matrix is its column-major transpose).
    ///
    /// # Safety
    /// The three addresses hold bf16 matrices of these shapes; nothing else writes them until
    /// the handle's stream has finished.
    unsafe fn queue(&self, handle: sys::cublasHandle_t, a: u64, b: u64, c: u64) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op = |t| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        let lda = if self.a_transposed { self.m } else { self.k };
        let ldb = if self.b_transposed { self.k } else { self.n };
        unsafe {
            blas::gemm_ex(
                handle,
                op(self.b_transposed),
                op(self.a_transposed),
                self.n as i32,
                self.m as i32,
                self.k as i32,
                (&alpha as *const f32).cast::<c_void>(),
                b as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                ldb as i32,
                a as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                lda as i32,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                sys::cudaDataType::CUDA_R_16BF,
                self.n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .expect("cublasGemmEx");
        }
    }
}

/// Row-major `c = op(a) b` through cuBLAS.
///
/// # Safety
/// As [`RowMajorGemm::queue`].
unsafe fn cublas_product(handle: sys::cublasHandle_t, p: &Product, a: u64, b: u64, c: u64) {
    let gemm = RowMajorGemm {
        m: p.m,
        n: p.n,
        k: p.k,
        a_transposed: p.transposed_lhs,
        b_transposed: false,
    };
    // SAFETY: as the caller vouches.
    unsafe { gemm.queue(handle, a, b, c) }
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
    let args = Args::parse();
    let iters = args.iters as usize;
    let device = CudaDevice::new(0);
    let context = CudaContext::new(0).expect("CUDA context");
    let stream: std::sync::Arc<CudaStream> = context.new_stream().expect("CUDA stream");
    let handle = blas::create_handle().expect("cuBLAS handle (is libcublas on the library path?)");
    // SAFETY: the handle and the stream were just created and outlive every call below.
    unsafe { blas::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
        .expect("cuBLAS stream");
    let blas = Blas { handle, stream };
    if args.hopper {
        hopper_table(iters, &device, &blas);
    } else {
        burn_table(iters, &device, &blas);
    }
    // SAFETY: the handle is not used after this.
    unsafe { blas::destroy_handle(handle) }.expect("destroy cuBLAS handle");
}

/// A cuBLAS handle and the stream it queues on.
struct Blas {
    handle: sys::cublasHandle_t,
    stream: std::sync::Arc<CudaStream>,
}

impl Blas {
    fn sync(&self) {
        self.stream.synchronize().expect("cuBLAS stream sync");
    }
}

/// Burn's matmul beside cuBLAS on the LLaMA-7B step's products.
fn burn_table(iters: usize, device: &CudaDevice, blas: &Blas) {
    let client = CudaRuntime::client(device);
    let handle = blas.handle;
    let sync_cube = || cubecl::future::block_on(client.sync()).expect("CubeCL sync");
    let sync_blas = || blas.sync();

    println!("| product | m x k x n | Burn (autotune) ms | TFLOP/s | cuBLAS ms | TFLOP/s | cuBLAS + host waits ms | max diff / max abs |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for p in &PRODUCTS {
        let lhs_dims = if p.transposed_lhs {
            [p.k, p.m]
        } else {
            [p.m, p.k]
        };
        let normal = Distribution::Normal(0.0, 1.0);
        let a = Tensor::<Cuda, 2>::random(lhs_dims, normal, device);
        let b = Tensor::<Cuda, 2>::random([p.k, p.n], normal, device);
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

        let out = Tensor::<Cuda, 2>::zeros([p.m, p.n], device);
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
}

/// `C[m, n]` shapes of the Hopper table: `(name, m, n, k)`.
const HOPPER_SHAPES: [(&str, usize, usize, usize); 4] = [
    ("square", 4096, 4096, 4096),
    ("square", 8192, 8192, 8192),
    ("q/k/v/o projection x W", 8192, 4096, 4096),
    ("gate/up x W", 8192, 11008, 4096),
];

/// The buffer of a contiguous bf16 Burn tensor as the kernels crate's tensor.
fn device_tensor(tensor: &Tensor<Cuda, 2>) -> DeviceTensor {
    let primitive = match tensor.clone().into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => panic!("float tensors only"),
    };
    assert!(primitive.is_contiguous(), "a contiguous row-major tensor");
    DeviceTensor {
        handle: primitive.handle.clone(),
        shape: primitive.shape().to_vec(),
        elem: ElemType::BF16,
    }
}

/// The Hopper matrix product beside cuBLAS, both layouts of B, bf16 out.
fn hopper_table(iters: usize, device: &CudaDevice, blas: &Blas) {
    let client = CudaRuntime::client(device);
    assert!(
        hopper::available(&client),
        "--hopper needs an H100 or H200 (CUDA compute capability 9.0)"
    );
    let sync_cube = || cubecl::future::block_on(client.sync()).expect("CubeCL sync");
    let address = |t: &DeviceTensor| {
        client
            .get_resource(t.handle.clone())
            .expect("device address")
    };
    println!("| product | m x n x k | B | first call s | ours ms | TFLOP/s | cuBLAS ms | TFLOP/s | ours / cuBLAS | max diff / max abs |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (name, m, n, k) in HOPPER_SHAPES {
        let normal = Distribution::Normal(0.0, 1.0);
        let a_burn = Tensor::<Cuda, 2>::random([m, k], normal, device);
        let flops = 2.0 * (m * n * k) as f64;
        for layout in [GemmLayout::BTransposed, GemmLayout::BRowMajor] {
            let (b_dims, b_transposed) = match layout {
                GemmLayout::BTransposed => ([n, k], true),
                GemmLayout::BRowMajor => ([k, n], false),
            };
            let b_burn = Tensor::<Cuda, 2>::random(b_dims, normal, device);
            let (a, b) = (device_tensor(&a_burn), device_tensor(&b_burn));
            let ours = DeviceTensor::empty(&client, vec![m, n], ElemType::BF16);
            let theirs = DeviceTensor::empty(&client, vec![m, n], ElemType::BF16);
            sync_cube();
            let run = || hopper::gemm(&client, &a, &b, &ours, layout).expect("Hopper product");
            let first = Instant::now();
            run();
            sync_cube();
            let first_secs = first.elapsed().as_secs_f64();
            let ours_secs = seconds_per_call(iters, run, sync_cube);

            let resources = [address(&a), address(&b), address(&theirs)];
            let [pa, pb, pc] = resources.each_ref().map(|r| r.resource().ptr);
            let gemm = RowMajorGemm {
                m,
                n,
                k,
                a_transposed: false,
                b_transposed,
            };
            // SAFETY: CubeCL's queue is drained (sync above) and touches none of these buffers
            // until the cuBLAS stream is synchronised.
            let blas_secs = seconds_per_call(
                iters,
                || unsafe { gemm.queue(blas.handle, pa, pb, pc) },
                || blas.sync(),
            );
            drop(resources);

            let reference = theirs.to_f32(&client);
            let got = ours.to_f32(&client);
            let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let diff = reference
                .iter()
                .zip(&got)
                .fold(0.0f32, |m, (r, o)| m.max((r - o).abs()));
            let layout_name = match layout {
                GemmLayout::BTransposed => "[N, K]",
                GemmLayout::BRowMajor => "[K, N]",
            };
            println!(
                "| {name} | {m} x {n} x {k} | {layout_name} | {first_secs:.2} | {:.3} | {:.0} | {:.3} | {:.0} | {:.2} | {:.1e} |",
                ours_secs * 1e3,
                flops / ours_secs / 1e12,
                blas_secs * 1e3,
                flops / blas_secs / 1e12,
                blas_secs / ours_secs,
                diff / scale,
            );
        }
    }
}
