"""The paper's analyses for one or more checkpoints, each a function returning data, a table formatter and a CLI
(`python -m diffjax.analysis.<name> --checkpoint DIR [--checkpoint DIR2 ...]`):

    needles           multi-needle retrieval accuracy by depth and context length (section 3.4, Figure 5, Table 2);
                      the same generator writes training examples
    attention_scores  attention to the answer span vs attention noise (Table 3)
    outliers          top-k and median magnitudes of attention logits and hidden states (Table 5)
    quantization      absmax-quantized attention logits at 8, 6, 4 bits against unquantized (Figure 8)
    recall            multi-query associative recall (Zoology's MQAR as text) by depth and pair count: a retrieval
                      task small models learn on a CPU (a function and a table; no CLI yet)

All four run the model through diffjax.analysis.probe, which recomputes each layer's attention from the layer's
own projections (so the maps and logits are visible and can be quantized) and equals the model's forward.
"""
