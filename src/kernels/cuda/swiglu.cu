// slotserve_swiglu: gate_up [R, 2I] -> out [R, I] = silu(gate) * up; gate columns then up
// columns, or with PAIRED alternating 8-column tiles of each (cuda.paired_rows). One
// thread per output element. Template: T (dtype), PAIRED. The body of an
// mx.fast.cuda_kernel (MLX writes the signature from gate_up -> out).

  const int R = gate_up_shape[0];
  const int I = gate_up_shape[1] / 2;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * I) return;
  const size_t r = i / I, c = i % I;
  const size_t gc = PAIRED ? c / 8 * 16 + c % 8 : c;
  const size_t uc = PAIRED ? gc + 8 : I + c;
  const float gt = static_cast<float>(gate_up[r * 2 * I + gc]);
  const float up = static_cast<float>(gate_up[r * 2 * I + uc]);
  out[i] = static_cast<T>(gt / (1.0f + expf(-gt)) * up);
