from ppdsl.cli import main

raise SystemExit(main())
