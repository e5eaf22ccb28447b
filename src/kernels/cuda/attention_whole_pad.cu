// paged_attention.cu's @PAD@ for the whole kernels: a padding tile's output rows are zeros.

    for (int i = tid; i < nrows * G * D; i += 128)
      out[((size_t)(first + i / (G * D)) * HQ + h * G) * D + i % (G * D)] = __float2bfloat16(0.0f);
