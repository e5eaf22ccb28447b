// attention_whole_out.cu's @LAST@ for kernels without MERGE (rope_attention): the row's
// max, sum and P.V sums are its one walk's.

      const float m = m_run[e], l = l_run[e];
      auto value = [&](int n, int c) { return o[n][c]; };
