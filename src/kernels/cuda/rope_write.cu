// slotserve_rope_write: fused QKV rows qkv [R, (HQ + 2 HKV) * D] -> q [R, HQ * D] rotated
// (rotate-half RoPE with the cos_t/sin_t rows of each row's position); k rotated and v go
// straight into the pool rows write_rows [n <= R, HKV] gives (kpool, vpool [rows, D],
// written in place: MLX sees them as inputs only). Rows n.. of qkv are padding and write
// nothing. One thread per element pair. Template: T (dtype), D (head dim), HKV. The body
// of an mx.fast.cuda_kernel (MLX writes the signature from qkv, cos_t, sin_t, positions,
// write_rows, kpool, vpool -> q).

  const int R = qkv_shape[0];
  const int W = qkv_shape[1];
  const int heads = W / D;              // HQ + 2 * HKV
  const int HQ = heads - 2 * HKV;
  const int half = D / 2;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;   // (row, head, d < half)
  if (i >= (size_t)R * heads * half) return;
  const int d = i % half;
  const int hd = (i / half) % heads;
  const int r = i / ((size_t)half * heads);
  const size_t src = (size_t)r * W + (size_t)hd * D;
  const bool writes = r < write_rows_shape[0];  // padding rows (past the real ones) write none
  if (hd >= HQ + HKV) {
    if (!writes) return;
    T* vp = const_cast<T*>(vpool);
    const size_t dst = (size_t)write_rows[(size_t)r * HKV + (hd - HQ - HKV)] * D;
    vp[dst + d] = qkv[src + d];
    vp[dst + d + half] = qkv[src + d + half];
    return;
  }
  const int p = positions[r];
  float r1, r2;
  rope_rotate(static_cast<float>(qkv[src + d]), static_cast<float>(qkv[src + d + half]),
              cos_t + (size_t)p * D + d, sin_t + (size_t)p * D + d, half, r1, r2);
  const T o1 = static_cast<T>(r1);
  const T o2 = static_cast<T>(r2);
  if (hd < HQ) {
    const size_t dst = ((size_t)r * HQ + hd) * D;
    q[dst + d] = o1;
    q[dst + d + half] = o2;
  } else if (writes) {
    T* kp = const_cast<T*>(kpool);
    const size_t dst = (size_t)write_rows[(size_t)r * HKV + (hd - HQ)] * D;
    kp[dst + d] = o1;
    kp[dst + d + half] = o2;
  }
