pub use distflash_kernels as kernels;
