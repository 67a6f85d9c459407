from kvledger.cli import main

raise SystemExit(main())
