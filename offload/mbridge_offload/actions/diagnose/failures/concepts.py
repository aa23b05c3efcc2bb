"""The ideas a user's description of a failure is made of, each with the words that express it."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- meaning

# The ideas a user's description is made of, each with the words that express it. A phrasing of a failure mode
# matches a text when every idea of the phrasing is in the text, however it is worded (diagnose.py).
CONCEPTS: dict[str, str] = {
    "gpu": r"\bgpus?\b|\bcuda\b|\bdevice\b|\bvram\b|\bhbm\b|\bcards?\b|\baccelerators?\b|\bh100\b|\ba100\b",
    "memory": r"\bmem(ory)?\b|\bvram\b|\bhbm\b|\ballocat\w*|\bfootprint|\b[gm]i?b\b|\busage\b|\bram\b",
    "host": r"\bhost\b|\bsystem (ram|memory)|\bram\b|\bdram\b|\bnode'?s? memory|\bmachine",
    "decrease": (
        r"\b(go|goes|going|gone|went|come|came|coming) down|\bdrop\w*|\bdecreas\w*|\breduc\w*|\blower\w*|"
        r"\bshr[iu]nk\w*|\bsmaller\b|\bfreed?\b|\bless\b|\bbenefit|\bhelp(s|ed)?\b|"
        # "save" as in memory, not as in a checkpoint
        r"(?<!checkpoint )(?<!ckpt )\bsav(e|ed|es|ing|ings)\b(?! (a |the )?(checkpoint|ckpt|state|optimizer|model))|"
        r"\bmove[sd]? the needle|\bimprov\w*"
    ),
    "negation": (
        r"\bnot?\b|\bnever\b|\bnothing\b|\bzero\b|\bnone\b|\bunchanged|\bsame\b|\bidentical|\bno effect|"
        r"n't\b|\bfail(s|ed)? to|\bbarely\b|\bhardly\b|\bstill\b|\bflat\b"
    ),
    "oom": (
        r"out of memory|\boom\b|outofmemory|\bran out|\bruns? out|\brunning out|\bexhaust\w*|not enough (\w+ )?memory|"
        r"exceed\w*.{0,30}(memory|capacity)|(memory|gpu|hbm|vram|device) (is |was |got )?full|too little memory|"
        r"does ?n[o']t fit|won't fit"
    ),
    "slow": (
        r"\bslow\w*|(?<!no )(?<!any )\blonger\b|\bcrawl\w*|\bsluggish|\btakes? (forever|ages)|\btimes slower|"
        r"\b\d+(\.\d+)?\s*x\s+(longer|more time)|\bdragg?ing|\blow (mfu|throughput|gpu utili[sz]ation)|"
        r"\b(throughput|performance|mfu|speed|tokens?/s|tflop/?s)( has| had)?( \w+)? (dropped|fell|regress\w*|tanked|"
        r"(gone|went|goes) down|decreased)"
    ),
    "time": (
        r"\bsteps?\b|\biterations?\b|\biters?\b|\btime\b|\bthroughput|\btokens?/s|\bsamples?/s|\bs/it\b|"
        r"\bseconds?\b|\bms\b|\bspeed|\bperformance|\btraining\b"
    ),
    "increase": (
        r"\bjump\w*|\bspik\w*|\bexplod\w*|\bdiverg\w*|\bblew up|\bblow(s|n)? up|\bskyrocket\w*|\bnan\b|"
        r"\bworse\b|\bhigher\b|\bincreas\w*|\bshot up|\bwent up|\bgoes up|\bdoubl\w*|\btripl\w*|\bgrew\b|\brose\b|"
        r"\bback to (its )?(initial|starting|random)"
    ),
    "loss": r"\bloss\w*|\bperplexity|\bppl\b|\bconverg\w*|\btraining curve",
    "resume": (
        r"\bresum\w*|\brestart\w*|\breload\w*|\brestor\w*|\bcheckpoints?\b|\bckpts?\b|\bload(ed|ing)?\b|"
        r"\bpick(ed|ing)? up (again|where)|\bcontinu\w*"
    ),
    "save": (
        r"\bsav(e|es|ed|ing)\b.{0,30}\b(checkpoint|ckpt|state|optimizer)|\b(checkpoint|ckpt)\w*.{0,20}\bsav|"
        r"\bwrit\w* (the |a )?(checkpoint|ckpt)|\bsave_checkpoint"
    ),
    "hang": (
        r"\bhang\w*|\bhung\b|\bstuck\b|\bfreez\w*|\bfroze\w*|\bdeadlock\w*|\bnever (finish|complet|return)\w*|"
        r"\bforever\b|\bno progress"
    ),
    "pinned": r"\bpin(ned|ning)?\b|\bpage.?locked|\bmemlock|\bulimit|\bhostalloc|\blocked memory",
    "killed": r"\bkill\w*|\bsigkill|\bterminated|\bdied\b|\bexit code 137|\breaped",
    "assert": r"\bassert\w*",
    "weights_only": r"weights.?only|unpickl\w*|safe.?globals|\bpickle",
    "activation": r"\bactivations?\b|\bcpu_offloading\b|\blayer.?level|\boffload(ed|ing)? (\d+ )?layers",
    "optimizer": r"\boptimi[sz]er|\badam\w*|\bhdo\b|hybriddeviceoptimizer|\bfraction",
    "offload": r"offload\w*|\bcpu offload|\bmov\w* (the )?\w* ?(states? )?to (the )?(cpu|host)",
    "pipeline": r"\bpipeline|\bpp\s*(=|>|is)?\s*[2-9]|\bpp\b",
    "recompute": r"\brecomput\w*|\bcheckpointing activations|\bactivation checkpointing",
    "cudagraph": r"cuda.?graphs?|\bcudagraph",
    "finetune": (
        r"\bfine.?tun\w*|\bpre.?trained\b|\bsft\b|\b(hf|hugging ?face) (checkpoint|weights|model)|"
        r"\bpretrained_checkpoint|\bbase model"
    ),
    "early_step": (
        r"\b(step|iteration|iter) ?(#)?(1|2|one|two)\b|\b(first|second) (optimizer )?(step|iteration|update)|"
        r"\bafter (one|the first) (step|update)"
    ),
    "random": (
        r"\brandom\w*|\buntrained|\bfrom scratch|\bln\(?vocab|\bcollaps\w*|\bgarbage|"
        r"\b(back to|like) (an? )?(random|init\w*|fresh)"
    ),
    "device_dtype": (
        r"same device and the same dtype|\b(device|dtype) mismatch|\bmismatch\w* (of )?(devices?|dtypes?)|"
        r"\bdifferent (devices?|dtypes?)|\bwrong (device|dtype)|\bmixed (devices?|dtypes?)|\bon (the )?cpu and"
    ),
    "state": r"\b(optimi[sz]er )?states?\b|\bexp_avg\w*|\bmoments?\b",
    "ranks": r"\branks?\b|\bacross (the )?(gpus|workers|processes)",
    "differ": r"\bdiffer\w*|\bmismatch\w*|\binconsistent|\bnot (the )?same\b",
    "double_buffer": r"double.?buffer\w*",
    "sizes": r"\bsizes?\b|\bshapes?\b",
    "fsdp": r"\bfsdp\b|megatron.?fsdp|\bm-?fsdp\b|\bdtensors?\b",
    "fused": r"\bfused ?adam\w*|\bfused (optimi[sz]er|kernel)|\bapex\b|transformer.?engine'?s? adam|\bte adam",
    "cpu": r"\bcpu\b",
    "nan": r"\bnans?\b|\bpoison\w*|\bgarbage (values|states)",
    "low_precision": (
        r"\bbf16\b|\bfp16\b|\bbfloat16\b|\bhalf.precision|\blow(er)?.precision|\bprecision.?aware|"
        r"\bexp_avg(_sq)?_dtype|\bmain_params_dtype"
    ),
    "fp32": r"\bfp32\b|\bfloat32\b|\bfull precision|\bsingle precision|\b4 bytes",
    "stale": (
        r"\bstale\b|\bprevious (step|iteration)'?s? grad\w*|\bold grad\w*|\bre-?appl\w*|\bapplied again|"
        r"\bleftover grad\w*|\bcached grad\w*|\blast step'?s? grad\w*"
    ),
    "megatron_lm": r"megatron.?lm\b|\bmlm\b|pretrain_gpt|megatron/training|\barguments\.py|\bvalidate_args",
    "args": (
        r"\bvalidate_args|\bargs?\b|\barguments?\b|\bflags?\b|\bargv\b|command.?line|\boptions?\b|"
        r"(?<![\w-])--[a-z][\w-]+"
    ),
    "failure": (
        r"\bfail\w*|\berrors?\b|\bassert\w*|\breject\w*|\brefus\w*|\bcrash\w*|\bbreaks?\b|\bbroke\w*|"
        r"\bcomplain\w*|\bdies\b|\bdied\b|\bexits?\b|won't (start|run)|does ?n[o']t (start|run|work)|\bblows? up"
    ),
    "no_grad": (
        r"\bno grad\w*|\bgrad(ient)? (is |was )?none|\bwithout (a )?grad\w*|\bunused (expert|param\w*)|"
        r"\bno tokens|\bnot routed|\bgets? no tokens|\b(receive|got)s? no tokens"
    ),
}
