"""Any HF ``*ForCausalLM`` / ``*ForSequenceClassification`` class no other family claims: the
stages run the model's own forward (torch half: runtime/stage/adapters/own.py). The layout is not written here: check
finds it by a meta trace of the forward (dsl/own_layout.py) and refuses the classes it cannot
split; the task comes from the class (``...ForSequenceClassification``), recorded in the plan."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="own",
    hf_classes={},
    task="causal_lm",  # the plan's model.task (by the class and its inputs) decides the loss
    stage="ppdsl.runtime.stage.adapters.own:OwnStage",
    layout=Layout("", (), ()),  # "": inferred from the model (lowering takes the trace's)
    layout_from_trace=True,
    # a token-fed classifier's synthetic data is padded (as BERT's and RoBERTa's families did)
    synthetic_padding=True,
    # a MoE block's grouped-mm experts do not run on meta (the trace): eager experts, the same in
    # the run, replicated (tp = 1)
    build_config={"experts_implementation": "eager"},
    # HF's forward adds the routers' load-balancing loss to the loss it returns; the stages return
    # the task's loss of the logits alone
    refuse={"output_router_logits": (False, "the router's auxiliary loss is not part of the pipeline's loss")},
)
