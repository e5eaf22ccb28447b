// paged_attention.cu's @PAD@ for slotserve_paged_attention_split: nothing (the combine
// writes the padding row's zeros).
