"""Fleet clients, launchers and the ROS 2 bridge."""
