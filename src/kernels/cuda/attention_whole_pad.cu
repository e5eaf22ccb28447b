// paged_attention.cu's @PAD@ for the whole kernels: a padding row's output is zeros.

    for (int i = tid; i < G * D; i += 128) out[base + i] = __float2bfloat16(0.0f);
