from strata.stage_worker.main import main

main()
