"""`python -m flowrl ...`: the `flowrl` command line, also as torchrun starts each rank of a
data-parallel run (`torchrun --nproc-per-node K -m flowrl train ...`, docs/distributed.md).

Under torchrun the entry is wrapped in torch.distributed.elastic's `record`, so a rank that raises
writes its traceback where torchrun reports it as the cause of the job's failure, and a rank that
returns ends through `end_rank_process` (no interpreter teardown, which can abort a finished rank).
"""

import os
import sys

from flowrl.cli import main

if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        from torch.distributed.elastic.multiprocessing.errors import record

        from flowrl.distributed.launch import end_rank_process

        end_rank_process(record(main)())
    sys.exit(main())
