import sys

from orangetron.cli import main

sys.exit(main())
