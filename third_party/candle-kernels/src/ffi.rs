//! edl's copy (third_party/README.md): the MoE kernels are not built, so these entry
//! points, which candle-nn's `moe` module calls, refuse instead of linking a static
//! library and `libcudart`.
use core::ffi::c_void;

/// # Safety
/// Never unsafe: it only panics.
#[allow(clippy::too_many_arguments)]
pub unsafe fn moe_gemm_wmma(
    _input: *const c_void,
    _weights: *const c_void,
    _sorted_token_ids: *const i32,
    _expert_ids: *const i32,
    _topk_weights: *const f32,
    _output: *mut c_void,
    _expert_counts: *mut i32,
    _expert_offsets: *mut i32,
    _num_experts: i32,
    _topk: i32,
    _size_m: i32,
    _size_n: i32,
    _size_k: i32,
    _dtype: i32,
    _is_prefill: bool,
    _stream: i64,
) {
    panic!("candle's MoE kernels are not part of edl's CUDA build (moe_gemm_wmma)")
}

/// # Safety
/// Never unsafe: it only panics.
#[allow(clippy::too_many_arguments)]
pub unsafe fn moe_gemm_gguf(
    _input: *const f32,
    _weights: *const c_void,
    _sorted_token_ids: *const i32,
    _expert_ids: *const i32,
    _topk_weights: *const f32,
    _output: *mut c_void,
    _num_experts: i32,
    _topk: i32,
    _size_m: i32,
    _size_n: i32,
    _size_k: i32,
    _gguf_dtype: i32,
    _stream: i64,
) {
    panic!("candle's MoE kernels are not part of edl's CUDA build (moe_gemm_gguf)")
}

/// # Safety
/// Never unsafe: it only panics.
#[allow(clippy::too_many_arguments)]
pub unsafe fn moe_gemm_gguf_prefill(
    _input: *const c_void,
    _weights: *const u8,
    _sorted_token_ids: *const i32,
    _expert_ids: *const i32,
    _topk_weights: *const f32,
    _output: *mut c_void,
    _num_experts: i32,
    _topk: i32,
    _size_m: i32,
    _size_n: i32,
    _size_k: i32,
    _input_dtype: i32,
    _gguf_dtype: i32,
    _stream: i64,
) {
    panic!("candle's MoE kernels are not part of edl's CUDA build (moe_gemm_gguf_prefill)")
}
