import sys

from arpo_trl.server.launcher import main

sys.exit(main())
