import sys

from memtoc.cli import main

sys.exit(main())
