import sys

from arpo_trl.server.serve_command import main

sys.exit(main())
