"""The train state's layout: one dict, which a checkpoint saves as its state item (diffjax.run_dir.STATE_ITEM). Its
keys are named here once, for the trainer that builds it (diffjax.train.step), the checkpoint readers
(diffjax.params_checkpoint, diffjax.train.state_checkpoints), LoRA's merge and the tools (diffjax.adoption):

    PARAMS          the params (an nnx pure dict); with LoRA only what trains ({lora.ADAPTERS, lora.BASE})
    OPT_STATE       the optax state of PARAMS
    STEP            int32, the optimizer steps taken
    RNG             uint32 key data of the run's key
    BASE_CHECKSUMS  LoRA only: the frozen base's lora.checksums (the adapters fit that base only)

A params-only checkpoint (a conversion's, a merge's) holds PARAMS alone.
"""

PARAMS, OPT_STATE, STEP, RNG, BASE_CHECKSUMS = "params", "opt_state", "step", "rng", "base_checksums"
