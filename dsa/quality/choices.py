"""What the quality commands offer on the command line (tasks, rules, k sweeps, teacher sizes), without
torch: ``dsa needle --help`` and ``dsa recall --help`` are built from these names alone."""

# dsa needle (dsa.quality.needle)
TASKS = ("needle", "multikey", "passkey")
RULES = ("dense", "oracle", "fitted", "sink_recent")

# dsa recall (dsa.quality.recall): the default k sweep, cut below the context
SWEEP = (64, 128, 256, 512, 1024, 2048, 4096)

# dsa recall --teacher (dsa.quality.teacher_recall)
DEFAULT_KS = "64,128,256,512,1024,2048"
TEACHER_PRESETS = {
    # a slice that runs in minutes on 2 CPU cores
    "cpu": dict(context=2048, layers="0-5", queries=32, windows=1, copy_seqs=1, passkey_seqs=2, topk="64,256,512,1024"),
    # the H200 run of benchmarks/results/quality-smollm2-*.json
    "full": dict(context=8192, layers="all", queries=128, windows=2, copy_seqs=4, passkey_seqs=8, topk=DEFAULT_KS),
}
