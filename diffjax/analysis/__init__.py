"""The paper's analyses for one or more checkpoints, each a function returning data, a table formatter and a CLI
(`python -m diffjax.analysis.<name> --checkpoint DIR [--checkpoint DIR2 ...] [--output OUT.json]`; --output writes
the results as JSON and the paper-style figure beside it, OUT.png, every checkpoint on one figure):

    needles           multi-needle retrieval accuracy by depth and context length (section 3.4, Figure 5, Table 2);
                      the same generator writes training examples. Figure: a depth x length heat map per model
    attention_scores  attention to the answer span vs attention noise (Table 3). Figure: bars by depth
    outliers          top-k and median magnitudes of attention logits and hidden states (Table 5). Figure: bars, log
    quantization      absmax-quantized attention logits at 8, 6, 4 bits against unquantized (Figure 8). Figure: each
                      metric against the bits, a line per model
    recall            multi-query associative recall (Zoology's MQAR as text) by depth and pair count: a retrieval
                      task small models learn on a CPU. Figure: a depth x pairs heat map per model

The figures (diffjax.analysis.figures) need matplotlib, the `plot` extra; without it the JSON is written and one
line says the figure was not. All of them run the model through diffjax.analysis.probe, which recomputes each
layer's attention from the layer's own projections (so the maps and logits are visible and can be quantized) and
equals the model's forward.
"""
