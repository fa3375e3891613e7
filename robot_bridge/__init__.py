"""ROS 2 deployment bridge. rclpy is imported only inside the node modules."""
