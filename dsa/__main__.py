from dsa.cli import main

raise SystemExit(main())
