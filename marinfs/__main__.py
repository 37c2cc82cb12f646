from marinfs.cli import main

raise SystemExit(main())
