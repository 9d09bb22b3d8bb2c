"""The checkpoint_name()s an attention op gives what it computes, for remat policies to keep by name
(diffjax.model.transformer.REMAT_POLICIES):

  OUTPUT_NAME            the op's output (every route; pallas_gpu names it inside its custom VJP)
  KERNEL_RESIDUALS_NAME  what pallas_gpu's single-map backward reads besides q, k, v and the output: the log-sum-exp
                         [B, N, 1, T] fp32 (2 MiB a layer for the 1.4B twin at micro-batch 8, T 4096)
  DIFF_RESIDUALS_NAME    the same for DIFF: the log-sum-exp [B, H, 2, T] and the second map O_2 [B, T, H, dv], fp32
                         (258 MiB a layer for the 1.4B DIFF model at micro-batch 8, T 4096)

pallas_gpu names its output and residuals on the very values its backward reads (inside the custom VJP's forward
rule): a policy that keeps them saves those, and the backward pass runs no forward kernel. Named outside the custom
VJP they would be other values, and the forward would run again to produce the ones it reads. remat="attention" keeps
OUTPUT_NAME and KERNEL_RESIDUALS_NAME, not DIFF_RESIDUALS_NAME: compiled for an H100, the 1.4B DIFF step keeping them
(+6.0 GiB) made XLA recompute the dq and dk/dv kernels to fit, where running the forward kernel again costs ~4.6% of
the step.
"""

OUTPUT_NAME = "attention_out"
KERNEL_RESIDUALS_NAME = "attention_kernel_residuals"
DIFF_RESIDUALS_NAME = "attention_diff_residuals"
