"""The checkpoint_name()s an attention op gives what it computes, for remat policies to keep by name
(diffjax.model.transformer.REMAT_POLICIES):

  OUTPUT_NAME            the op's output (every route; pallas_gpu names it inside its custom VJP)
  KERNEL_RESIDUALS_NAME  what a fused kernel's backward reads besides q, k, v and the output: pallas_gpu's
                         log-sum-exp [B, H, M, T] fp32 and DIFF's second map O_2 [B, T, H, dv] fp32

pallas_gpu names its output and residuals on the very values its backward reads (inside the custom VJP's forward
rule): a policy that keeps both names then saves them, and the backward pass runs no forward kernel. Named outside
the custom VJP they would be other values, and the forward would run again to produce the ones it reads.
"""

OUTPUT_NAME = "attention_out"
KERNEL_RESIDUALS_NAME = "attention_kernel_residuals"
